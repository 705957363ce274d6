//! Procedural macros for `trellis-outbox`. Use them through the `trellis_outbox` crate.
