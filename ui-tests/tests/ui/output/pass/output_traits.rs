// Proves: the run output implements `Debug`, `Clone`, `PartialEq` and `Eq` when every leaf output does,
// and a flow whose leaf output implements none of them still compiles.
use pgflow_runtime::{flow, Flow, StepError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Greeting {
    pub text: String,
}

/// Implements only what a step output needs.
#[derive(Serialize, Deserialize)]
pub struct Blob {
    pub bytes: Vec<u8>,
}

#[flow(slug = "hello", input = String)]
mod hello {
    use super::*;

    #[step]
    async fn greet(name: String) -> Result<Greeting, StepError> {
        Ok(Greeting { text: format!("hello {name}") })
    }

    #[step(depends_on = [greet])]
    async fn shout(greet: Greeting) -> Result<String, StepError> {
        Ok(greet.text.to_uppercase())
    }

    #[step(depends_on = [greet], if = { greet: { text: "hello x" } })]
    async fn maybe(greet: Greeting) -> Result<Vec<Greeting>, StepError> {
        Ok(vec![greet])
    }
}

#[flow(slug = "opaque", input = u8)]
mod opaque {
    use super::*;

    #[step]
    async fn make(n: u8) -> Result<Blob, StepError> {
        Ok(Blob { bytes: vec![n] })
    }
}

fn assert_common<T: std::fmt::Debug + Clone + PartialEq + Eq>() {}

fn main() {
    assert_common::<<Hello as Flow>::Output>();
    let out: hello::HelloOutput = serde_json::from_value(serde_json::json!({"shout": "HELLO ADA"})).unwrap();
    let copy = out.clone();
    assert_eq!(out, copy);
    assert_eq!(format!("{out:?}"), r#"HelloOutput { shout: "HELLO ADA", maybe: None }"#);
    let other = hello::HelloOutput { shout: "HI".into(), maybe: Some(vec![Greeting { text: "x".into() }]) };
    assert_ne!(out, other);

    let opaque: opaque::OpaqueOutput = serde_json::from_value(serde_json::json!({"make": {"bytes": [1]}})).unwrap();
    assert_eq!(opaque.make.bytes, vec![1]);
}
