//! The Rust snippets of the README and of docs/privacy.md, compiled and run
//! as doc tests: `cargo test -p readme`
//! (and CI's `cargo test --workspace`) fails when one no longer builds.
//! Snippets that need a server or a broker are `no_run`; their imports and
//! dependencies are this crate's dev-dependencies, the ones a user adds.
#![forbid(unsafe_code)]

#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[doc = include_str!("../../../docs/privacy.md")]
#[cfg(doctest)]
pub struct PrivacyDoctests;
