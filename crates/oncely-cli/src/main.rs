//! The `oncely` command: the command line parsed and dispatched to the
//! command's module in `oncely_cli::commands`, and an error mapped to the
//! exit code. Each command's arguments, run and printing live there.
#![forbid(unsafe_code)]
// `run` awaits every command's future, and the deepest (opening any backend
// through a host list, then the pipeline) nests past the default 128 when
// the release build computes its layout ("queries overflow the depth
// limit").
#![recursion_limit = "256"]

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use oncely::Error;
use oncely_cli::commands::{
    abandoned, bench, chaos, demo, erase, forget, get, history, inspect, migrate, prune, reconcile,
    reencrypt, relay, resolve, serve, stats, stuck,
};

/// Make job and message handlers safe to run twice.
///
/// oncely records each effect (a charge, an email) under a key derived from
/// the business fact, claimed atomically in a database, so a redelivered or
/// concurrent duplicate message changes nothing. This command runs the
/// double-charge demo, measures duplicates next to hand-written code, and
/// lets operators inspect and maintain a ledger.
///
/// Database URLs: sqlite:PATH or sqlite://PATH (add ?mode=rwc to create the
/// file), postgres://USER@HOST/DB, mysql://USER@HOST/DB or mariadb://USER@HOST/DB,
/// redis://HOST:PORT[/DB] (one server), redis+cluster://HOST:PORT,HOST:PORT,...
/// (a Redis Cluster's seed nodes), redis+sentinel://HOST:PORT,...,/MASTER[/DB]
/// (the primary Sentinel names; add ?wait_replicas=N to acknowledge writes only
/// once N replicas have them; on any Redis URL, ?ephemeral=true writes to a
/// server that persists nothing), nats://HOST:PORT[,HOST:PORT...] with
/// optional ?bucket=NAME&replicas=1|3 (JetStream KV), memory: (an empty
/// in-process ledger). The URL names the ledger's table too: ?table=T on
/// SQLite and MySQL (whose schema is the URL's database), ?schema=S&table=T
/// on PostgreSQL, ?prefix=P on Redis, ?bucket=B on NATS; an unknown
/// parameter is a usage error. Every answer names the ledger it read.
///
/// Exit codes: 0 success; 1 runtime failure (database unreachable, backend
/// error, oncely charged twice in the demo, an effect ran twice in the
/// bench, resolve or forget refused: a live lease, a fence that moved;
/// reconcile could not settle a record); 2 usage error (bad arguments, invalid key or tenant, unknown URL
/// scheme, a command the backend does not offer); 3 `get`, `inspect`,
/// `resolve` or `forget` found no record.
#[derive(Debug, Parser)]
#[command(name = "oncely", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One variant per command; its help is the doc comment of the command's
/// `Args`.
#[derive(Debug, Subcommand)]
enum Command {
    Demo(demo::Args),
    Bench(bench::Args),
    Chaos(chaos::Args),
    Get(get::Args),
    Inspect(inspect::Args),
    History(history::Args),
    Stats(stats::Args),
    Stuck(stuck::Args),
    Abandoned(abandoned::Args),
    Resolve(resolve::Args),
    Reconcile(reconcile::Args),
    Forget(forget::Args),
    Reencrypt(reencrypt::Args),
    Erase(erase::Args),
    Prune(prune::Args),
    Relay(relay::Args),
    Migrate(migrate::Args),
    Serve(serve::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

async fn run(command: Command) -> oncely::Result<ExitCode> {
    match command {
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Get(args) => get::run(args).await,
        Command::Inspect(args) => inspect::run(args).await,
        Command::History(args) => history::run(args).await,
        Command::Stats(args) => stats::run(args).await,
        Command::Stuck(args) => stuck::run(args).await,
        Command::Abandoned(args) => abandoned::run(args).await,
        Command::Resolve(args) => resolve::run(args).await,
        Command::Reconcile(args) => reconcile::run(args).await,
        Command::Forget(args) => forget::run(args).await,
        Command::Reencrypt(args) => reencrypt::run(args).await,
        Command::Erase(args) => erase::run(args).await,
        Command::Prune(args) => prune::run(args).await,
        Command::Relay(args) => relay::run(args).await,
        Command::Migrate(args) => migrate::run(args).await,
        Command::Serve(args) => serve::run(args).await,
    }
}

/// Prints the error and picks the exit code: 2 for what the caller can fix
/// in the command line, 3 for a record that is not there, 1 for everything
/// that went wrong at run time.
fn fail(e: &Error) -> ExitCode {
    eprintln!("error: {e}");
    match e {
        Error::InvalidKey { .. }
        | Error::Config(_)
        | Error::Misuse(_)
        | Error::InvalidInput(_)
        | Error::OutcomeTooLarge { .. } => ExitCode::from(2),
        Error::NotFound { .. } => ExitCode::from(3),
        _ => ExitCode::from(1),
    }
}
