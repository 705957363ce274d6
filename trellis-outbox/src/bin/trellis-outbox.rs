//! `trellis-outbox`: see `trellis-outbox --help`.

fn main() {
    trellis_outbox::cli::main();
}
