//! The Rust statement of the queue-name rules (`pgflow_sql::names`, which the `#[flow]` macro and the
//! runtime use) agrees with SQL's `pgflow.resolve_step_queues`: same names, and for a rejected flow
//! the same SQLSTATE, the same step and index, and identical MESSAGE / DETAIL / HINT.

use std::collections::BTreeMap;

use pgflow_sql::names::{resolve_step_queues, QueueNameError};
use pgflow_tests::test_db;

use crate::step_support::db_error;

/// A deterministic generator, so a failing case is reproducible.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % below.max(1)
    }

    /// A valid slug of `len` characters, mixed case.
    fn slug(&mut self, len: usize) -> String {
        const FIRST: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_";
        const REST: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_";
        let mut s = String::with_capacity(len);
        s.push(FIRST[self.next(FIRST.len())] as char);
        while s.len() < len {
            s.push(REST[self.next(REST.len())] as char);
        }
        s
    }

    /// One of the ways a slug breaks `pgflow.is_valid_slug`.
    fn invalid_slug(&mut self) -> String {
        match self.next(4) {
            0 => "run".to_owned(),
            1 => format!("{}{}", self.next(10), self.slug(4)),
            2 => format!("{}-{}", self.slug(3), self.slug(3)),
            _ => self.slug(129),
        }
    }
}

/// The letter-case twin of a slug (same queue name, different slug); `None` without letters.
fn case_twin(slug: &str) -> Option<String> {
    let twin: String = slug
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    (twin != slug).then_some(twin)
}

/// The error kind, telling SQL's two PF010 cases apart.
fn kind(e: &QueueNameError) -> &'static str {
    match e {
        QueueNameError::EmptyFlow { .. } => "PF010 (no steps)",
        QueueNameError::InvalidFlowSlug { .. } => "22023 (flow slug)",
        QueueNameError::InvalidStepSlug { .. } => "22023 (step slug)",
        other => other.sqlstate(),
    }
}

#[tokio::test]
async fn the_rust_and_sql_queue_resolvers_agree_on_generated_cases_errors_included() {
    let db = test_db().await;
    let pool = db.pool();
    let mut rng = Lcg(0x5eed);
    let mut kinds: BTreeMap<&'static str, usize> = BTreeMap::new();
    for case in 0..1_200 {
        // Boundary-heavy lengths: flow slugs around 43-48, steps around the 47 total, and flows of
        // 44 characters with more than ten steps (index 10's fallback is 48 characters).
        let at_index_ten = case % 8 == 3;
        let flow_len = match case % 8 {
            0 | 4 => 40 + rng.next(10),
            1 | 5 => 1 + rng.next(30),
            3 => 44,
            _ => 10 + rng.next(40),
        };
        let flow = if rng.next(40) == 0 {
            rng.invalid_slug()
        } else {
            rng.slug(flow_len)
        };
        let steps_n = if at_index_ten {
            11 + rng.next(3)
        } else {
            rng.next(13) // 0 is an empty flow
        };
        let mut steps: Vec<String> = Vec::new();
        for _ in 0..steps_n {
            let room = 47usize.saturating_sub(flow_len + 2);
            let s = match rng.next(40) {
                0 => rng.invalid_slug(),
                1 | 2 => match steps.last().and_then(|s| case_twin(s)) {
                    Some(twin) => twin,
                    None => rng.slug(3),
                },
                n => {
                    let len = match n % 3 {
                        0 => room.max(1),
                        1 => room + 1,
                        _ => 1 + rng.next(30),
                    };
                    rng.slug(len)
                }
            };
            if steps.contains(&s) {
                continue;
            }
            steps.push(s);
        }
        let refs: Vec<&str> = steps.iter().map(String::as_str).collect();
        let ours = resolve_step_queues(&flow, &refs);
        let sql: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(
            "select queue_name from pgflow.resolve_step_queues(flow_slug => $1, step_slugs => $2) order by step_index",
        )
        .bind(&flow)
        .bind(&steps)
        .fetch_all(pool)
        .await;
        match (ours, sql) {
            (Ok(ours), Ok(sql)) => {
                assert_eq!(ours, sql, "flow {flow} steps {steps:?}");
                *kinds.entry("resolved").or_default() += 1;
            }
            (Err(ours), Err(sql)) => {
                let sql = db_error(sql);
                assert_eq!(
                    (
                        ours.sqlstate(),
                        ours.message(),
                        ours.detail(),
                        Some(ours.hint().to_owned())
                    ),
                    (sql.code.code(), sql.message.clone(), sql.detail, sql.hint),
                    "flow {flow} steps {steps:?}"
                );
                // The step and index the typed error names are the ones SQL names.
                if let Some((step, index)) = ours.step() {
                    assert_eq!(steps.get(index).map(String::as_str), Some(step));
                    assert!(
                        sql.message
                            .contains(&format!("\"{step}\" at index {index} "))
                            || sql.message.contains(&format!("\"{step}\" (index {index})")),
                        "{ours:?} vs {}",
                        sql.message
                    );
                }
                *kinds.entry(kind(&ours)).or_default() += 1;
            }
            (ours, sql) => panic!(
                "resolvers disagree for flow {flow} steps {steps:?}: rust {ours:?}, sql {sql:?}"
            ),
        }
    }
    // Every outcome is exercised, most of them many times.
    for (kind, min) in [
        ("resolved", 300),
        ("PF010", 100),
        ("PF010 (no steps)", 20),
        ("PF011", 50),
        ("PF012", 20),
        ("22023 (flow slug)", 10),
        ("22023 (step slug)", 10),
    ] {
        let n = kinds.get(kind).copied().unwrap_or(0);
        assert!(n >= min, "{kind}: {n} cases, wanted {min}; all: {kinds:?}");
    }
}
