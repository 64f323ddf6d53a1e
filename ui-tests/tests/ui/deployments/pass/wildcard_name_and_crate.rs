// Proves: a `_ =>` arm routes every remaining step to one queue; the struct defaults to the function name in UpperCamelCase with its visibility and docs; `name = ..` and `crate = ..` work.
#![deny(missing_docs)]
//! A crate with a deployment whose struct is public and documented.

use pgflow_runtime::{deployment, flow, queue, Deployment, Queue, RoutesTo, Routing};

mod reexport {
    pub use pgflow_runtime as rt;
}

/// A three-step flow.
#[flow(slug = "ingestV3", input = String)]
pub mod ingest {
    use pgflow_runtime::StepError;

    #[step]
    async fn fetch(url: String) -> Result<String, StepError> {
        Ok(url)
    }

    #[step(depends_on = [fetch])]
    async fn parse(fetch: String) -> Result<String, StepError> {
        Ok(fetch)
    }

    #[step(depends_on = [parse])]
    async fn store(parse: String) -> Result<(), StepError> {
        let _ = parse;
        Ok(())
    }
}

/// Network-bound work.
#[queue("network")]
pub struct Network;

/// Everything else.
#[queue("cpu")]
pub struct Cpu;

/// Fetch on the network queue, the rest on the CPU queue.
#[deployment(alias = "ingest")]
pub fn ingest_live(step: ingest::Step) {
    match step {
        ingest::Step::Fetch => Network,
        _ => Cpu,
    }
}

#[deployment(alias = "ingestCanary", name = Canary, crate = "crate::reexport::rt")]
fn ingest_canary(s: ingest::Step) {
    match s {
        _ => Cpu,
    }
}

fn routes_to<Q: Queue, D: RoutesTo<Q>>() {}

fn main() {
    let Routing::Named(route) = IngestLive::routing() else {
        panic!("not a named deployment")
    };
    assert_eq!(route(ingest::Step::Fetch), "network");
    assert_eq!(route(ingest::Step::Parse), "cpu");
    assert_eq!(route(ingest::Step::Store), "cpu");
    routes_to::<Network, IngestLive>();
    routes_to::<Cpu, IngestLive>();

    assert_eq!(Canary::ALIAS, Some("ingestCanary"));
    let Routing::Named(route) = <Canary as Deployment>::routing() else {
        panic!("not a named deployment")
    };
    assert!(ingest::Step::ALL.iter().all(|s| route(*s) == Cpu::NAME));
    routes_to::<Cpu, Canary>();
    assert_eq!(format!("{:?}", IngestLive), "IngestLive");
}
