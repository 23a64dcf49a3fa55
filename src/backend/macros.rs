//! Macros that write the ~400 op forwards of `Amp<B>`. They carry no policy: float ops
//! ask [`super::policy`] what to cast, everything else goes to `B` untouched.

/// Forwards each listed op to the inner backend `B`, unchanged.
macro_rules! forward {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;)*) => {$(
        $(#[$attr])*
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            B::$name($($arg),*)
        }
    )*};
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
/// `=> [..]` (`t` a tensor, `opt` an `Option`, `vec` a `Vec`) are cast as
/// `Op::name`'s category says, then `B` runs the op.
macro_rules! autocast_ops {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        => [$($kind:ident $input:ident),* $(,)?];)*) => {$(
        $(#[$attr])*
        #[inline(always)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[allow(unused_mut, unused_variables)]
            let mut autocast = $crate::backend::policy::Autocast::<B>::new(
                $crate::backend::policy::Op::$name,
            );
            $(autocast_input!(see $kind autocast $input);)*
            #[allow(unused_variables)]
            let target = autocast.target();
            $(let $input = autocast_input!(cast $kind target $input);)*
            B::$name($($arg),*)
        }
    )*};
}

/// One float input of [`autocast!`]: observe it, or cast it.
macro_rules! autocast_input {
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
    (cast t $target:ident $x:ident) => {
        $crate::backend::policy::cast::<B>($x, $target)
    };
    (cast opt $target:ident $x:ident) => {
        $x.map(|x| $crate::backend::policy::cast::<B>(x, $target))
    };
    (cast vec $target:ident $x:ident) => {
        match $target {
            None => $x,
            Some(_) => $x
                .into_iter()
                .map(|x| $crate::backend::policy::cast::<B>(x, $target))
                .collect(),
        }
    };
}

pub(crate) use {autocast_input, autocast_ops, forward, forward_primitive};
