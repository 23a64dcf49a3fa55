//! The backend traits of `Amp<B>`, one file per trait, like burn-autodiff's `ops/`.

mod activation;
mod bool;
mod float;
mod int;
mod module;
mod quantized;
mod transaction;
