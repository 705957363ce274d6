//! `trellis-outbox`: see `trellis-outbox --help`.

fn main() {
    let stdout = std::io::stdout();
    if let Err(error) = trellis_outbox::cli::run(std::env::args_os(), &mut stdout.lock()) {
        match error.downcast_ref::<clap::Error>() {
            Some(clap_error) => clap_error.exit(),
            None => {
                eprintln!("error: {error}");
                std::process::exit(1);
            }
        }
    }
}
