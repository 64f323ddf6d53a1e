//! Parsing of the filter arguments: times (`2h` ago or RFC 3339) and input matches (`path=value`).

use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde_json::Value;

/// A point in time given on the command line: a duration ago (`90s`, `2h`, `3days`) or an RFC 3339
/// timestamp (`2026-12-01T08:00:00Z`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct When(pub(crate) DateTime<Utc>);

impl FromStr for When {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(ago) = humantime::parse_duration(s) {
            let ago = chrono::Duration::from_std(ago)
                .map_err(|_| format!("`{s}` is too long a duration"))?;
            return Ok(When(Utc::now() - ago));
        }
        DateTime::parse_from_rfc3339(s)
            .map(|t| When(t.with_timezone(&Utc)))
            .map_err(|_| {
                format!(
                    "`{s}` is neither a duration ago (`90s`, `2h`, `3days`) nor an RFC 3339 time \
                     (`2026-12-01T08:00:00Z`)"
                )
            })
    }
}

/// An input match: the JSON value at a dotted path of the run input (`tenant.id=42`). The value is JSON
/// when it parses as JSON (`42`, `true`, `"42"`, `{"a":1}`), and a string otherwise (`name=ada`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InputEq {
    /// The keys (or array positions) from the input's root.
    pub(crate) path: Vec<String>,
    /// The value there.
    pub(crate) value: Value,
}

impl FromStr for InputEq {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (path, value) = s.split_once('=').ok_or_else(|| {
            format!("`{s}` has no `=`: write PATH=VALUE, for example `tenant.id=42`")
        })?;
        let path: Vec<String> = path.split('.').map(str::to_owned).collect();
        if path.iter().any(String::is_empty) {
            return Err(format!(
                "`{s}`: the path has an empty key; separate keys with single dots, for example `tenant.id=42`"
            ));
        }
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
        Ok(InputEq { path, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_matches_parse_json_values_and_fall_back_to_strings() {
        let m: InputEq = "tenant.id=42".parse().unwrap();
        assert_eq!(m.path, ["tenant", "id"]);
        assert_eq!(m.value, serde_json::json!(42));
        let m: InputEq = "name=ada".parse().unwrap();
        assert_eq!(m.value, serde_json::json!("ada"));
        let m: InputEq = "name=\"42\"".parse().unwrap();
        assert_eq!(m.value, serde_json::json!("42"));
        assert!("tenant.id".parse::<InputEq>().is_err());
        assert!("tenant..id=1".parse::<InputEq>().is_err());
    }

    #[test]
    fn times_are_durations_ago_or_rfc3339() {
        let before = Utc::now();
        let When(t) = "2h".parse().unwrap();
        let two_hours = chrono::Duration::hours(2);
        assert!(t <= before - two_hours + chrono::Duration::seconds(5));
        assert!(t >= before - two_hours - chrono::Duration::seconds(5));
        let When(t) = "2026-12-01T08:00:00Z".parse().unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-01T08:00:00+00:00");
        assert!("yesterday-ish".parse::<When>().is_err());
    }
}
