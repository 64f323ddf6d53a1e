//! Decoding the SQL core's answers: text columns that hold one of a fixed set of values become enums, read
//! with sqlx (as a column) or serde (inside a JSON answer). A value this build does not know is a decode
//! error that names the type and the value, never a default.

/// Declares an enum of the values a text column (or JSON string) can hold, with `as_str`, `Display`,
/// decoding from a text column (`sqlx::Decode`) and from JSON (`serde::Deserialize`), and `Serialize` as the
/// same text.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $text:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)*
        }

        impl $name {
            /// The SQL text of the value.
            $vis const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }

            #[allow(dead_code)]
            pub(crate) fn parse(text: &str) -> Result<Self, String> {
                match text {
                    $($text => Ok($name::$variant),)*
                    other => Err(format!(
                        concat!("unknown ", stringify!($name), " `{}` (this build knows {})"),
                        other,
                        [$(concat!("`", $text, "`")),*].join(", ")
                    )),
                }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = String;

            /// Parses the SQL text of a value; the error names the value and the values this build knows.
            fn from_str(text: &str) -> Result<Self, String> {
                Self::parse(text)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::sqlx::Type<::sqlx::Postgres> for $name {
            fn type_info() -> ::sqlx::postgres::PgTypeInfo {
                <str as ::sqlx::Type<::sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &::sqlx::postgres::PgTypeInfo) -> bool {
                <&str as ::sqlx::Type<::sqlx::Postgres>>::compatible(ty)
            }
        }

        impl<'r> ::sqlx::Decode<'r, ::sqlx::Postgres> for $name {
            fn decode(
                value: ::sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, ::sqlx::error::BoxDynError> {
                let text = <&str as ::sqlx::Decode<'r, ::sqlx::Postgres>>::decode(value)?;
                Ok(Self::parse(text)?)
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = <::std::borrow::Cow<'de, str> as ::serde::Deserialize<'de>>::deserialize(d)?;
                Self::parse(&text).map_err(<D::Error as ::serde::de::Error>::custom)
            }
        }
    };
}

pub(crate) use text_enum;

text_enum! {
    /// What recording one result did (`outcome` of `pgflow.complete_tasks`, `pgflow.fail_task` and the
    /// completion rows of `pgflow.exchange`).
    pub(crate) enum Recorded {
        /// This call recorded the result.
        Applied = "applied",
        /// It changed nothing: the attempt is no longer current, or the task already finished.
        Stale = "stale",
    }
}

text_enum! {
    /// A task's status (`pgflow.step_tasks.status`).
    #[non_exhaustive]
    pub enum TaskStatus {
        /// Waiting in its queue (for a failure: it will be retried).
        Queued = "queued",
        /// Claimed and running.
        Started = "started",
        /// Its output is recorded.
        Completed = "completed",
        /// Failed for good.
        Failed = "failed",
        /// Skipped by a condition.
        Skipped = "skipped",
        /// Its run failed or was cancelled first.
        Cancelled = "cancelled",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_decode_and_an_unknown_one_is_an_error_naming_it() {
        assert_eq!(TaskStatus::parse("queued"), Ok(TaskStatus::Queued));
        assert_eq!(TaskStatus::Cancelled.as_str(), "cancelled");
        let e = Recorded::parse("maybe").unwrap_err();
        assert!(
            e.contains("unknown Recorded `maybe`") && e.contains("`applied`"),
            "{e}"
        );
        let json: Result<Recorded, _> = serde_json::from_value(serde_json::json!("applied"));
        assert_eq!(json.unwrap(), Recorded::Applied);
        assert!(serde_json::from_value::<Recorded>(serde_json::json!("nope")).is_err());
    }
}

text_enum! {
    /// A step's kind (`pgflow.steps.step_type`).
    #[non_exhaustive]
    pub enum StepType {
        /// One task, run once.
        Single = "single",
        /// One task per element of its input array.
        Map = "map",
    }
}

text_enum! {
    /// How a flow version routes its steps to queues (`pgflow.flows.queue_mode`).
    #[non_exhaustive]
    pub enum QueueMode {
        /// Every step on the flow's single default queue (`lower(flow_slug)`).
        Flow = "flow",
        /// Every step on its own private queue.
        Step = "step",
        /// Every step on a named, shared queue.
        Named = "named",
    }
}
