//! Write safety: the write credential, operator sessions, CSRF tokens and the same-origin check.
//!
//! A session cookie holds the operator's name and a MAC of it under the write token; the CSRF token of a
//! session is another MAC of the name under the token. Neither reveals the token, both change with it, and a
//! page from another site can read neither.

use axum::http::HeaderMap;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The cookie that carries an operator session.
pub(crate) const SESSION_COOKIE: &str = "pgflow_dashboard_session";

/// The write credential and what is derived from it.
pub(crate) struct WriteAuth {
    token: String,
}

impl std::fmt::Debug for WriteAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WriteAuth(..)")
    }
}

impl WriteAuth {
    pub(crate) fn new(token: String) -> Self {
        Self { token }
    }

    fn mac(&self, purpose: &str, actor: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(self.token.as_bytes())
            .expect("HMAC takes a key of any length");
        mac.update(purpose.as_bytes());
        mac.update(b"\0");
        mac.update(actor.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `given` is the write token (in constant time).
    pub(crate) fn token_matches(&self, given: &str) -> bool {
        // Comparing MACs of both keeps the comparison constant-time whatever the lengths.
        let expected = self.mac("token", &self.token);
        let given = self.mac("token", given);
        expected.as_bytes().ct_eq(given.as_bytes()).into()
    }

    /// The session cookie value for `actor`.
    pub(crate) fn session_value(&self, actor: &str) -> String {
        format!("{actor}.{}", self.mac("session", actor))
    }

    /// The operator of a session cookie value, when its MAC is right.
    pub(crate) fn session_actor(&self, value: &str) -> Option<String> {
        let (actor, mac) = value.rsplit_once('.')?;
        let expected = self.mac("session", actor);
        (valid_actor(actor) && bool::from(expected.as_bytes().ct_eq(mac.as_bytes())))
            .then(|| actor.to_owned())
    }

    /// The CSRF token of `actor`'s session.
    pub(crate) fn csrf(&self, actor: &str) -> String {
        self.mac("csrf", actor)
    }

    /// Whether `given` is the CSRF token of `actor`'s session.
    pub(crate) fn csrf_matches(&self, actor: &str, given: &str) -> bool {
        self.csrf(actor).as_bytes().ct_eq(given.as_bytes()).into()
    }
}

/// An operator name: 1 to 64 letters, digits and `._@-`.
pub(crate) fn valid_actor(actor: &str) -> bool {
    (1..=64).contains(&actor.len())
        && actor
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@-".contains(&b))
}

/// Refuses a request that a page of another site made: `Sec-Fetch-Site` must be `same-origin` when the
/// browser sends it, and `Origin`, when sent, must name the host the request went to.
pub(crate) fn same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    if let Some(site) = headers.get("sec-fetch-site") {
        return if site.as_bytes() == b"same-origin" {
            Ok(())
        } else {
            Err("the request came from another site (Sec-Fetch-Site is not same-origin)")
        };
    }
    if let Some(origin) = headers.get("origin") {
        let host = headers
            .get("host")
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let origin = origin.to_str().unwrap_or("");
        let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
        if origin_host.is_empty() || origin_host != host {
            return Err("the request came from another origin (Origin does not match Host)");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn sessions_and_csrf_tokens_follow_the_write_token() {
        let auth = WriteAuth::new("s3cret".into());
        assert!(auth.token_matches("s3cret"));
        assert!(!auth.token_matches("s3cre"));
        let cookie = auth.session_value("alice");
        assert_eq!(auth.session_actor(&cookie).as_deref(), Some("alice"));
        assert_eq!(
            auth.session_actor(&cookie.replace("alice", "mallory")),
            None
        );
        let other = WriteAuth::new("other".into());
        assert_eq!(other.session_actor(&cookie), None);
        assert!(auth.csrf_matches("alice", &auth.csrf("alice")));
        assert!(!auth.csrf_matches("alice", &other.csrf("alice")));
        assert!(!auth.csrf_matches("bob", &auth.csrf("alice")));
    }

    #[test]
    fn cross_site_requests_are_refused() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&h).is_ok());
        h.insert("origin", HeaderValue::from_static("http://127.0.0.1:8080"));
        assert!(same_origin(&h).is_ok());
        h.insert("origin", HeaderValue::from_static("http://evil.example"));
        assert!(same_origin(&h).is_err());
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(same_origin(&h).is_err());
        h.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(same_origin(&h).is_ok());
    }
}
