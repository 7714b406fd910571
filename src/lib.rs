//! flatnn: a neural-network engine with static shapes and zero allocation per step.

pub mod cpu;
