//! Hello, pgflow: a two-step flow, a worker, a start, a wait and a print.
//!
//! `cargo run -p pgflow-examples --bin hello` (a throwaway PostgreSQL when `DATABASE_URL` is unset).

use std::time::Duration;

use pgflow_runtime::prelude::*;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// What the first step makes of the input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Greeting {
    /// The greeting.
    pub text: String,
}

/// `greet` runs first; `shout` takes its output once it is done.
#[flow(slug = "hello", input = String)]
pub mod hello {
    use super::*;

    /// The root step: takes the flow input.
    #[step]
    async fn greet(name: String) -> Result<Greeting, StepError> {
        Ok(Greeting {
            text: format!("hello, {name}"),
        })
    }

    /// Depends on `greet` and takes its output by name.
    #[step(depends_on = [greet])]
    async fn shout(greet: Greeting) -> Result<String, StepError> {
        Ok(greet.text.to_uppercase())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[tokio::test]
        async fn a_step_is_a_plain_async_function() {
            let out = greet("Ada".into()).await.unwrap();
            assert_eq!(out.text, "hello, Ada");
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A database of its own with pgflow installed: on DATABASE_URL's server, or a throwaway one.
    let db = pgflow_sql::throwaway::fresh_database(pgflow_sql::throwaway::Contents::Empty).await?;
    let pool = db.pool().clone();
    pgflow_sql::install(&pool).await?;

    // A worker in this process; in production it runs in its own (`run_until_signal`).
    let worker = Worker::<hello::Hello>::builder(pool.clone())
        .build()?
        .spawn(CancellationToken::new())
        .await?;

    let client = Client::new(pool);
    let run = client.start::<hello::Hello>(&"world".to_owned()).await?;
    let out = run.wait(Duration::from_secs(30)).await?;
    println!("{out:?}");

    worker.stop().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgflow_runtime::testing;

    #[tokio::test]
    async fn the_flow_runs_to_completion() {
        let db = testing::database().await.unwrap();
        let out = testing::run::<hello::Hello>(db.pool(), &"Ada".to_owned())
            .await
            .unwrap();
        assert_eq!(out.shout, "HELLO, ADA");
    }
}
