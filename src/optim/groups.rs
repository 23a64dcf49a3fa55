//! Parameter groups: options for the parameters under a module path, PyTorch's
//! `param_groups` (each group its learning rate and weight decay) and timm's `lr_scale`
//! (layer-wise learning-rate decay), for the fused optimizers.
//!
//! A group names parameters by their path in the module, as Burn's module visitor spells it
//! (field names and `Vec` indices joined by dots: `encoder.layers.3.attn.query.weight`), not
//! by `ParamId`: ids are made afresh when a model is built and replaced when a record is
//! loaded, so a group of ids taken from a new model would silently miss a loaded one.
//!
//! A pattern is dot-separated segments; `*` in a segment matches any run of characters
//! within it (`norm*`, `*_proj`), a `**` segment any number of segments. A pattern matches a
//! parameter whose path it matches whole or up to a dot, so that a module's name takes its
//! subtree: `encoder`, `layers.0`, `**.bias`, `**.norm*`. The first group that matches a
//! parameter sets its options; a parameter no group matches has the optimizer's.
//!
//! Groups apply where burn-amp's adaptor steps (what `FusedAdamWConfig::init` and
//! `FusedSgdConfig::init` return). Inside Burn's own `OptimizerAdaptor` an optimizer is
//! handed tensors without their paths: its groups do nothing there, and its first step says
//! so in the log.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::config::Config;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;

use super::OptimError;

/// Options for the parameters under one module path (see the [module docs](self)).
#[derive(Config, Debug, PartialEq)]
pub struct ParamGroup {
    /// The module path pattern (`encoder`, `**.bias`, `layers.*.attn`).
    pub path: String,
    /// The learning rate of the group: the step's learning rate times this (timm's
    /// `lr_scale`; 0 leaves the group's parameters where they are while their state follows).
    #[config(default = 1.0)]
    pub lr_scale: f64,
    /// The group's weight decay, in place of the optimizer's, and whatever its
    /// `weight_decay_min_rank` says (`Some(0.0)`: no decay for biases and norm scales, the
    /// Hugging Face Trainer's group).
    #[config(default = "None")]
    pub weight_decay: Option<f32>,
}

/// Warns once per process that `groups` go unused: a step that came without the parameter's
/// path (Burn's `OptimizerAdaptor`).
pub(crate) fn warn_unplaced(groups: &[ParamGroup]) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !groups.is_empty() && !WARNED.swap(true, Ordering::Relaxed) {
        log::warn!(
            "burn-amp: a fused optimizer with {} parameter group(s) steps inside Burn's \
             OptimizerAdaptor, which gives no parameter paths: the groups do nothing. Use the \
             adaptor that its config's init() returns",
            groups.len()
        );
    }
}

/// Checks `groups`: each pattern well formed, each value in range.
pub(crate) fn validate(optimizer: &'static str, groups: &[ParamGroup]) -> Result<(), OptimError> {
    for (index, group) in groups.iter().enumerate() {
        let invalid = |what: String| OptimError::InvalidParamGroup {
            optimizer,
            index,
            path: group.path.clone(),
            what,
        };
        if group.path.is_empty() || group.path.split('.').any(str::is_empty) {
            return Err(invalid(
                "the path is empty or has an empty segment (write `a.b`, `**.bias`)".into(),
            ));
        }
        if !(group.lr_scale.is_finite() && group.lr_scale >= 0.0) {
            return Err(invalid(format!(
                "lr_scale = {}, expected a finite number >= 0",
                group.lr_scale
            )));
        }
        if let Some(decay) = group.weight_decay
            && !(decay.is_finite() && decay >= 0.0)
        {
            return Err(invalid(format!(
                "weight_decay = {decay}, expected a finite number >= 0"
            )));
        }
    }
    Ok(())
}

/// The first group whose pattern matches `path`, and its index.
pub(crate) fn group_of<'a>(
    groups: &'a [ParamGroup],
    path: &str,
) -> Option<(usize, &'a ParamGroup)> {
    if groups.is_empty() {
        return None;
    }
    let segments: Vec<&str> = path.split('.').collect();
    groups.iter().enumerate().find(|(_, group)| {
        let pattern: Vec<&str> = group.path.split('.').collect();
        matches_prefix(&pattern, &segments)
    })
}

/// Whether `pattern` matches `path` or one of its leading runs of segments.
fn matches_prefix(pattern: &[&str], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => true,
        Some((&"**", rest)) => (0..=path.len()).any(|skip| matches_prefix(rest, &path[skip..])),
        Some((segment, rest)) => match path.split_first() {
            Some((name, tail)) => glob(segment, name) && matches_prefix(rest, tail),
            None => false,
        },
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| glob(tail, &rest[i..]))
        }
    }
}

/// The dotted path of the module a visitor or mapper is in (`enter_module` pushes a name):
/// the parameter groups' paths, and the doctor's.
#[derive(Debug, Default)]
pub(crate) struct ModulePath(Vec<String>);

impl ModulePath {
    pub fn enter(&mut self, name: &str) {
        self.0.push(name.to_owned());
    }

    pub fn exit(&mut self) {
        self.0.pop();
    }

    pub fn joined(&self) -> String {
        self.0.join(".")
    }
}

/// Each float parameter of `module`: its path and the index of its group in `groups`.
pub(crate) fn param_groups_of<B: Backend, M: Module<B>>(
    module: &M,
    groups: &[ParamGroup],
) -> Vec<(String, Option<usize>)> {
    struct Visit<'a> {
        path: ModulePath,
        groups: &'a [ParamGroup],
        found: Vec<(String, Option<usize>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Visit<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<B, D>>) {
            let path = self.path.joined();
            let group = group_of(self.groups, &path).map(|(index, _)| index);
            self.found.push((path, group));
        }
    }
    let mut visit = Visit {
        path: ModulePath::default(),
        groups,
        found: Vec::new(),
    };
    module.visit(&mut visit);
    visit.found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &str, path: &str) -> bool {
        let group = ParamGroup::new(pattern.into());
        group_of(core::slice::from_ref(&group), path).is_some()
    }

    #[test]
    fn patterns_match_whole_segments_and_subtrees() {
        let path = "encoder.layers.3.attn.query.weight";
        for (pattern, expected) in [
            ("encoder", true),
            ("encoder.layers", true),
            ("encode", false),
            ("encoder.layers.3", true),
            ("encoder.layers.30", false),
            ("encoder.layers.*.attn", true),
            ("**.weight", true),
            ("**.bias", false),
            ("**.query", true),
            ("**.que*", true),
            ("**.*ry", true),
            ("**.q*y.weight", true),
            ("**.q*x", false),
            ("**", true),
            ("layers", false),
            ("**.layers.3", true),
            ("encoder.**.weight", true),
            ("encoder.**.layers.3.attn.query.weight", true),
            ("encoder.layers.3.attn.query.weight.x", false),
        ] {
            assert_eq!(matches(pattern, path), expected, "{pattern} on {path}");
        }
    }

    #[test]
    fn the_first_matching_group_wins() {
        let groups = [
            ParamGroup::new("**.bias".into()).with_weight_decay(Some(0.0)),
            ParamGroup::new("head".into()).with_lr_scale(10.0),
        ];
        assert_eq!(group_of(&groups, "head.bias").map(|(i, _)| i), Some(0));
        assert_eq!(group_of(&groups, "head.weight").map(|(i, _)| i), Some(1));
        assert_eq!(group_of(&groups, "body.weight").map(|(i, _)| i), None);
    }

    #[test]
    fn bad_groups_are_refused_with_what_was_wrong() {
        let refused = |group: ParamGroup| validate("FusedAdamW", &[group]).unwrap_err().to_string();
        let message = refused(ParamGroup::new("encoder..weight".into()));
        assert!(message.contains("empty segment"), "{message}");
        let message = refused(ParamGroup::new("head".into()).with_lr_scale(-1.0));
        assert!(message.contains("lr_scale = -1"), "{message}");
        let message = refused(ParamGroup::new("head".into()).with_weight_decay(Some(f32::NAN)));
        assert!(message.contains("weight_decay = NaN"), "{message}");
        assert!(message.contains("group 0 (`head`)"), "{message}");
        validate("FusedAdamW", &[ParamGroup::new("**.bias".into())]).unwrap();
    }
}
