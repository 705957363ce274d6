//! Test support for the trellis-outbox workspace.
