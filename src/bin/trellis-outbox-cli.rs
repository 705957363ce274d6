//! The `trellis-outbox` tool, built in this package so its tests can run the binary
//! (`CARGO_BIN_EXE_trellis-outbox-cli`).

fn main() {
    trellis_outbox::cli::main();
}
