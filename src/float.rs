//! The scalar the plain-loop specification is written over: `f32` for the engine's reference,
//! `f64` for finite-difference gradient checks.

use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// A real number type for the plain CPU loops (the spec).
pub trait Float:
    Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
    fn exp(self) -> Self;
    /// e^x − 1, accurate near 0.
    fn exp_m1(self) -> Self;
    fn ln(self) -> Self;
    /// ln(1 + x), accurate near 0.
    fn ln_1p(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
}

macro_rules! float_impl {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn of(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn exp_m1(self) -> Self {
                <$t>::exp_m1(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
float_impl!(f32);
float_impl!(f64);
