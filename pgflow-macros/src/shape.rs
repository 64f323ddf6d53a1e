//! The flow shape document the worker compiles into Postgres, as SQL's `_get_flow_shape` returns it.

use serde_json::{json, Map, Value};

use crate::ast::{Flow, Kind};
use crate::attr::RunOptions;

/// The shape document, `{"steps": [...], "options": {...}}`.
pub(crate) fn shape(flow: &Flow) -> Value {
    let pattern = |p: &Option<Value>| -> Value {
        match p {
            None => json!({ "defined": false }),
            Some(v) => json!({ "defined": true, "value": v }),
        }
    };
    let steps: Vec<Value> = flow
        .steps
        .iter()
        .map(|s| {
            let mut deps: Vec<&str> = s
                .deps
                .iter()
                .map(|d| flow.steps[d.index].slug.value.as_str())
                .collect();
            deps.sort_unstable();
            let mut o = Map::new();
            o.insert("slug".into(), Value::from(s.slug.value.clone()));
            o.insert(
                "stepType".into(),
                Value::from(match s.kind() {
                    Kind::Map => "map",
                    Kind::Single => "single",
                }),
            );
            o.insert("dependencies".into(), Value::from(deps));
            o.insert("whenUnmet".into(), Value::from(s.when_unmet().as_sql()));
            o.insert(
                "whenExhausted".into(),
                Value::from(s.when_exhausted().as_sql()),
            );
            o.insert("requiredInputPattern".into(), pattern(&s.if_value));
            o.insert("forbiddenInputPattern".into(), pattern(&s.if_not_value));
            let options = options(&s.attrs.options);
            if !options.is_empty() {
                o.insert("options".into(), Value::Object(options));
            }
            Value::Object(o)
        })
        .collect();
    let mut doc = Map::new();
    doc.insert("steps".into(), Value::Array(steps));
    let options = options(&flow.attrs.options);
    if !options.is_empty() {
        doc.insert("options".into(), Value::Object(options));
    }
    Value::Object(doc)
}

/// The options that were given, under the shape's camelCase keys.
fn options(o: &RunOptions) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, opt) in [
        ("maxAttempts", &o.max_attempts),
        ("baseDelay", &o.base_delay),
        ("timeout", &o.timeout),
        ("startDelay", &o.start_delay),
    ] {
        if let Some(v) = opt.get() {
            out.insert(key.into(), Value::from(v.value));
        }
    }
    out
}
