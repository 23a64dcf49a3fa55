//! Macros that write the ~400 op forwards of `Amp<B>`. They carry no policy: float ops
//! ask [`super::policy`] what to cast, everything else goes to `B` untouched (but for ops on
//! empty tensors, which `B`'s CUDA kernels cannot run: `workarounds::empty`).

/// Forwards each listed op to the inner backend `B`, unchanged (an op marked `=> via
/// workarounds`: through that module, see [`autocast_call!`]; one marked `=> empty`: its
/// empty result made here when an input is empty, see [`forward_empty!`]).
macro_rules! forward {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        $(=> via $module:ident)?
        $(=> empty [$kind:ident $first:ident $(, $kinds:ident $inputs:ident)*] $out:ident($dtype:expr))?;)*) => {$(
        $(#[$attr])*
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            $(forward_empty!($out($dtype) $kind $first $(, $inputs)*);)?
            $crate::backend::macros::autocast_call!($($module)? $name($($arg),*))
        }
    )*};
}

/// An int or bool op marked `=> empty [inputs] out(dtype)` (its result has the broadcast shape
/// of its tensor inputs, an `out` tensor of `dtype`): with an empty input, its empty result,
/// made without `B`'s kernel (which CUDA refuses). The first input gives the device.
macro_rules! forward_empty {
    ($out:ident($dtype:expr) $kind:ident $first:ident $(, $input:ident)*) => {
        let shapes = [
            burn_backend::TensorMetadata::shape(&$first),
            $(burn_backend::TensorMetadata::shape(&$input),)*
        ];
        if let Some(shape) = $crate::backend::workarounds::empty::empty_broadcast(&shapes) {
            let device = forward_empty!(@device $kind $first);
            return forward_empty!(@made $out shape device $dtype);
        }
    };
    (@device int $x:ident) => { B::int_device(&$x) };
    (@device bool $x:ident) => { B::bool_device(&$x) };
    (@made int $shape:ident $device:ident $dtype:expr) => { B::int_empty($shape, &$device, $dtype) };
    (@made bool $shape:ident $device:ident $dtype:expr) => { B::bool_empty($shape, &$device, $dtype) };
    (@made float $shape:ident $device:ident $dtype:expr) => { B::float_empty($shape, &$device, $dtype) };
}

/// Forwards each listed op to `B` and rewraps its `TensorPrimitive<B>` result as
/// `TensorPrimitive<Amp<B>>` (same payload, another type parameter).
macro_rules! forward_primitive {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {$(
        $(#[$attr])*
        #[inline(always)]
        fn $name($($arg: $ty),*) -> $ret {
            rewrap(B::$name($($arg),*))
        }
    )*};
}

/// Forwards each listed float op through the policy: the float inputs named in
/// `=> [..]` (`t` a tensor, `opt` an `Option`, `vec` a `Vec`; `s` a scalar operand, never
/// cast) are cast as `Op::name`'s category says, then `B` runs the op. While a
/// [doctor](crate::doctor) session is on, a probe sees the inputs and the output (off, it
/// costs one atomic load).
macro_rules! autocast_ops {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        => [$($kind:ident $input:ident),* $(,)?] $(via $module:ident)?;)*) => {$(
        $(#[$attr])*
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[allow(unused_mut, unused_variables)]
            let mut autocast = $crate::backend::policy::Autocast::<B>::new(
                $crate::backend::policy::Op::$name,
            );
            $(autocast_input!(see $kind autocast $input);)*
            #[allow(unused_variables)]
            let plan = autocast.plan();
            #[allow(unused_variables)]
            let target = plan.target;
            autocast_empty!([$($ret)?] $name target [$($kind $input),*]);
            #[allow(unused_mut)]
            let mut probe = $crate::doctor::Probe::<B>::start($crate::backend::policy::Op::$name);
            if let Some(probe) = probe.as_mut() {
                $(autocast_input!(probe $kind probe $input);)*
                $(probe_dim!($arg probe $arg);)*
                if probe.wants_shadow(target) {
                    // The same op in f32 on the same inputs: what it loses in half precision
                    // (through the same module as the op itself: a workaround's defect must
                    // not show as a precision loss).
                    #[allow(unused_variables, clippy::clone_on_copy, clippy::redundant_clone, noop_method_call)]
                    let shadow = {
                        $(let $arg = ::core::clone::Clone::clone(&$arg);)*
                        $(let $input = autocast_input!(shadow $kind $input);)*
                        autocast_call!($($module)? $name($($arg),*))
                    };
                    probe.shadow(&shadow);
                }
            }
            $(let $input = autocast_input!(cast $kind plan $input);)*
            #[allow(unused_variables)]
            if let Some(probe) = probe.as_mut() {
                $(autocast_input!(probe_cast $kind probe $input);)*
            }
            let out = autocast_call!($($module)? $name($($arg),*));
            if let Some(probe) = probe {
                probe.finish(&out);
            }
            out
        }
    )*};
}

/// An argument named `dim` is told to the probe (the precision report compares an op's
/// choices along it); any other argument is not.
macro_rules! probe_dim {
    (dim $p:ident $dim:ident) => {
        $p.along($dim)
    };
    ($other:ident $p:ident $arg:ident) => {};
}

/// An elementwise op (`workarounds::empty::Elementwise`) with an empty float input:
/// its empty result, made without `B`'s kernel (which CUDA refuses). Code only where the op is
/// elementwise (a constant test otherwise).
macro_rules! autocast_empty {
    ([$ret:ty] $name:ident $target:ident [$($kind:ident $input:ident),*]) => {
        #[allow(unused_mut)]
        if let Some(mut guard) = $crate::backend::workarounds::empty::EmptyInputs::<B>::new(
            $crate::backend::policy::Op::$name,
        ) {
            $(autocast_empty!(@see $kind guard $input);)*
            if guard.hit() {
                $(autocast_empty!(@keep $kind guard $input);)*
                if let Some(out) = guard.result::<$ret>($target) {
                    return out;
                }
            }
        }
    };
    ([] $($rest:tt)*) => {};
    (@see t $guard:ident $x:ident) => { $guard.see(&$x) };
    (@see $kind:ident $guard:ident $x:ident) => {};
    (@keep t $guard:ident $x:ident) => { $guard.keep(&$x) };
    (@keep $kind:ident $guard:ident $x:ident) => {};
}

/// The op itself: `B`'s, or for an op marked `via module`, that module's (`recompute`: the
/// backward recomputes its output; `workarounds`: a defect of Burn 0.21 avoided).
macro_rules! autocast_call {
    ($name:ident($($arg:ident),*)) => {
        B::$name($($arg),*)
    };
    ($module:ident $name:ident($($arg:ident),*)) => {
        $crate::backend::$module::$name::<B>($($arg),*)
    };
}

/// One float input of [`autocast_ops!`]: observe it, cast it, or show it to a probe.
macro_rules! autocast_input {
    (see s $cx:ident $x:ident) => {};
    (see t $cx:ident $x:ident) => {
        $cx.see(&$x)
    };
    (see opt $cx:ident $x:ident) => {
        if let Some(x) = &$x {
            $cx.see(x)
        }
    };
    (see vec $cx:ident $x:ident) => {
        for x in &$x {
            $cx.see(x)
        }
    };
    (cast s $plan:ident $x:ident) => {
        $x
    };
    (cast t $plan:ident $x:ident) => {
        $plan.cast::<B>($x)
    };
    (cast opt $plan:ident $x:ident) => {
        $x.map(|x| $plan.cast::<B>(x))
    };
    (cast vec $plan:ident $x:ident) => {
        match $plan.target {
            None => $x,
            Some(_) => $x.into_iter().map(|x| $plan.cast::<B>(x)).collect(),
        }
    };
    (probe s $p:ident $x:ident) => {
        $p.scalar(&$x)
    };
    (probe t $p:ident $x:ident) => {
        $p.input(&$x)
    };
    (probe opt $p:ident $x:ident) => {
        if let Some(x) = &$x {
            $p.input(x)
        }
    };
    (probe vec $p:ident $x:ident) => {
        for x in &$x {
            $p.input(x)
        }
    };
    (probe_cast s $p:ident $x:ident) => {};
    (probe_cast t $p:ident $x:ident) => {
        $p.cast_input(&$x)
    };
    (probe_cast opt $p:ident $x:ident) => {
        if let Some(x) = &$x {
            $p.cast_input(x)
        }
    };
    (probe_cast vec $p:ident $x:ident) => {
        for x in &$x {
            $p.cast_input(x)
        }
    };
    (shadow s $x:ident) => {
        $x
    };
    (shadow t $x:ident) => {
        $crate::doctor::Probe::<B>::shadow_input(&$x)
    };
    (shadow opt $x:ident) => {
        $x.as_ref().map($crate::doctor::Probe::<B>::shadow_input)
    };
    (shadow vec $x:ident) => {
        $x.iter()
            .map($crate::doctor::Probe::<B>::shadow_input)
            .collect()
    };
}

pub(crate) use {
    autocast_call, autocast_empty, autocast_input, autocast_ops, forward, forward_empty,
    forward_primitive, probe_dim,
};
