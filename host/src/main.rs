//! The `laneway` binary: parses the command line, runs the command, and turns
//! errors into one line on standard error and a non-zero exit.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use laneway::cli::{self, Io};
use tracing_subscriber::EnvFilter;

/// mimalloc rather than glibc's malloc: a drain allocates and frees small
/// rows, lanes and futures on every round across threads, and glibc spent a
/// seventh of the drain's CPU consolidating and freeing them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match cli::parse(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints usage or help itself, to the right stream.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    // The demo tells its story in its progress and report; its host's log
    // would scroll through the progress bars, so it is off unless asked for.
    // The bench prints tables; its hosts' info lines would bury them.
    let default = match cli.command {
        cli::Command::Demo(_) => "off",
        cli::Command::Bench(_) => "warn",
        _ => "info",
    };
    let filter = EnvFilter::try_from_env("LANEWAY_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // Colours only for a person at a terminal; LANEWAY_LOG_FORMAT=json for
    // log shippers.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if std::env::var("LANEWAY_LOG_FORMAT").is_ok_and(|f| f == "json") {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("laneway: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let io = Io {
        env: laneway::config::process_env(),
        stdin: &mut stdin,
        stdout: &mut stdout,
    };
    match runtime.block_on(cli::run(cli, io)) {
        Ok(()) => ExitCode::SUCCESS,
        // A reader that stopped early (`| head`) is not an error worth a line.
        Err(cli::CliError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("laneway: {e}");
            ExitCode::FAILURE
        }
    }
}
