// Proves: `name = ..` renames the flow type, `crate = ..` overrides the runtime path, the slug defaults to the module name, and `StepResult<T>` is accepted.
#[allow(unused_imports)]
use pgflow_runtime::{flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub text: String,
}
mod reexport {
    pub use pgflow_runtime as rt;
}

#[flow(input = Thread, name = Greeter, crate = "crate::reexport::rt")]
pub mod greet_user {
    use super::*;
    use pgflow_runtime::StepResult;

    #[step(slug = "greetUser")]
    async fn greet(thread: Thread) -> StepResult<String> {
        Ok(format!("hi {}", thread.text))
    }
}

fn main() {
    use pgflow_runtime::Flow;
    assert_eq!(Greeter::SLUG, "greet_user");
    assert_eq!(greet_user::Greeter::SLUG, "greet_user");
    assert_eq!(greet_user::Step::Greet.slug(), "greetUser");
}
