//! The one data-plane error type, and the one place that turns it into a status and a
//! JSON body: `{"error":{"type":..,"message":..,"route":..,...}}`.

use serde_json::{json, Map, Value};

use crate::http::{status_reason, HeadError};

#[derive(Debug)]
pub enum ProxyError {
    BadRequestHead(HeadError),
    HeadTimeout,
    BodyTimeout,
    BodyTooLarge {
        limit: u64,
    },
    BadChunkedBody,
    UnknownRoute {
        known: Vec<String>,
    },
    NotFound,
    NoHealthyPeer,
    ConnectFailed {
        peer: String,
        detail: String,
    },
    ConnectTimeout {
        peer: String,
    },
    UpstreamTimeout {
        peer: String,
    },
    BadUpstreamResponse {
        peer: String,
        detail: &'static str,
    },
    UpstreamClosed {
        peer: String,
    },
    /// The router's drain deadline came while `peer` had not answered yet, or (`None`)
    /// while the request's body was still arriving.
    ShuttingDown {
        peer: Option<String>,
    },
    ClientGone,
    Forbidden(&'static str),
    BadParam(String),
    Unauthorized,
    ModelNotSupported {
        model: Option<String>,
        supported: Vec<String>,
    },
    /// The gate's figures, and with session turn priority on the request's turn bucket
    /// (its index in `_session_status`'s table and its first turn), its share, and the
    /// ceiling the gate applied to it (`⌈limit × rt_factor × share⌉`); and, when the limit
    /// was the adaptive one, the static pool limit it moves under. Kept out of
    /// [`ConcurrencyFigures`], which every request builds.
    ConcurrencyLimit(
        ConcurrencyFigures,
        Option<Box<(usize, u64, f64, f64)>>,
        Option<f64>,
    ),
    RejectedByRule {
        rule: String,
        message: String,
        status: u16,
    },
    /// The TTFT or decode-rate gate shed the request.
    LatencyShed {
        gate: &'static str,
        ewma: f64,
        threshold: f64,
        /// The pool's (or the request's) model and the gate's metric name (`p90`, `avg`),
        /// boxed: only a refusal builds them.
        names: Box<(Option<String>, String)>,
        healthy_peers: usize,
        active_level: i32,
        /// The pool's 5-minute sampled in-flight average (SPEC §5.5).
        avg_5min: f64,
    },
}

/// The figures a concurrency 429 reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConcurrencyFigures {
    /// The limit in force: the pool's healthy capacity, or the adaptive limit (fractional).
    pub limit: f64,
    pub inflight: i64,
    pub rt_factor: f64,
    pub healthy_peers: usize,
    pub active_level: i32,
    /// The pool's 5-minute sampled in-flight average (SPEC §5.5), filled in when the gate
    /// refuses (it is read from the segment only then).
    pub avg_5min: f64,
}

impl ProxyError {
    pub fn status(&self) -> u16 {
        match self {
            ProxyError::BadRequestHead(e) => e.status(),
            ProxyError::HeadTimeout | ProxyError::BodyTimeout => 408,
            ProxyError::BodyTooLarge { .. } => 413,
            ProxyError::BadChunkedBody | ProxyError::BadParam(_) => 400,
            ProxyError::UnknownRoute { .. } | ProxyError::NotFound => 404,
            ProxyError::NoHealthyPeer | ProxyError::ShuttingDown { .. } => 503,
            ProxyError::ConnectFailed { .. }
            | ProxyError::BadUpstreamResponse { .. }
            | ProxyError::UpstreamClosed { .. } => 502,
            ProxyError::ConnectTimeout { .. } | ProxyError::UpstreamTimeout { .. } => 504,
            ProxyError::ClientGone => 499,
            ProxyError::Forbidden(_) => 403,
            ProxyError::Unauthorized => 401,
            ProxyError::ModelNotSupported { .. } => 400,
            ProxyError::ConcurrencyLimit(..) => 429,
            ProxyError::RejectedByRule { status, .. } => *status,
            ProxyError::LatencyShed { .. } => 429,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::BadRequestHead(HeadError::TooLarge | HeadError::TooManyHeaders) => {
                "request_header_too_large"
            }
            ProxyError::BadRequestHead(HeadError::UnsupportedCoding) => "not_implemented",
            ProxyError::BadRequestHead(
                HeadError::UnsupportedVersion | HeadError::LaterMinor { .. },
            ) => "http_version_not_supported",
            ProxyError::BadRequestHead(HeadError::UriTooLong) => "uri_too_long",
            ProxyError::BadRequestHead(HeadError::MethodNotAllowed) => "method_not_allowed",
            ProxyError::BadRequestHead(_) | ProxyError::BadChunkedBody => "bad_request",
            ProxyError::HeadTimeout | ProxyError::BodyTimeout => "request_timeout",
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::UnknownRoute { .. } => "unknown_route",
            ProxyError::NotFound => "not_found",
            ProxyError::NoHealthyPeer => "no_healthy_upstream",
            ProxyError::ConnectFailed { .. } => "upstream_connect_failed",
            ProxyError::ConnectTimeout { .. } => "upstream_connect_timeout",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::BadUpstreamResponse { .. } => "bad_upstream_response",
            ProxyError::UpstreamClosed { .. } => "upstream_closed",
            ProxyError::ShuttingDown { .. } => "shutting_down",
            ProxyError::ClientGone => "client_gone",
            ProxyError::Forbidden(_) => "forbidden",
            ProxyError::BadParam(_) => "bad_parameter",
            ProxyError::Unauthorized => "unauthorized",
            ProxyError::ModelNotSupported { .. } => "model_not_supported",
            ProxyError::ConcurrencyLimit(..) => "concurrency_limit_exceeded",
            ProxyError::RejectedByRule { .. } => "rejected_by_rule",
            ProxyError::LatencyShed { gate: "ttft", .. } => "ttft_limit_exceeded",
            ProxyError::LatencyShed { .. } => "tps_limit_exceeded",
        }
    }

    fn message(&self) -> String {
        match self {
            ProxyError::BadRequestHead(e) => e.message().to_string(),
            ProxyError::HeadTimeout => "request head not received in time".into(),
            ProxyError::BodyTimeout => "request body not received in time".into(),
            ProxyError::BodyTooLarge { limit } => {
                format!("request body exceeds the route's limit of {limit} bytes")
            }
            ProxyError::BadChunkedBody => "malformed chunked request body".into(),
            ProxyError::UnknownRoute { .. } => "no route by that name".into(),
            ProxyError::NotFound => "not found".into(),
            ProxyError::NoHealthyPeer => "no healthy upstream in any tier of the pool".into(),
            ProxyError::ConnectFailed { peer, detail } => {
                format!("cannot connect to {peer}: {detail}")
            }
            ProxyError::ConnectTimeout { peer } => format!("connecting to {peer} timed out"),
            ProxyError::UpstreamTimeout { peer } => format!("{peer} did not respond in time"),
            ProxyError::BadUpstreamResponse { peer, detail } => {
                format!("invalid response from {peer}: {detail}")
            }
            ProxyError::UpstreamClosed { peer } => {
                format!("{peer} closed the connection before responding")
            }
            ProxyError::ShuttingDown { peer: None } => {
                "the router is shutting down and the request body had not arrived by its drain deadline".into()
            }
            ProxyError::ShuttingDown { peer: Some(peer) } => {
                format!("the router is shutting down and {peer} had not responded by its drain deadline")
            }
            ProxyError::ClientGone => "client closed the connection".into(),
            ProxyError::Forbidden(m) => (*m).into(),
            ProxyError::BadParam(m) => m.clone(),
            ProxyError::Unauthorized => "missing or invalid api key".into(),
            ProxyError::ModelNotSupported { model, supported } => match model {
                _ if supported.is_empty() => {
                    "no route lists models: send the request to /<route>/v1/...".into()
                }
                Some(m) => format!("model '{m}' is not served here"),
                None => "the request names no model this route serves".into(),
            },
            ProxyError::ConcurrencyLimit(..) => "concurrency limit exceeded".into(),
            ProxyError::RejectedByRule { message, .. } => message.clone(),
            ProxyError::LatencyShed { gate: "ttft", .. } => {
                "time to first token above the route's limit".into()
            }
            ProxyError::LatencyShed { .. } => "decode rate below the route's limit".into(),
        }
    }

    /// Extra headers the status calls for.
    pub fn headers(&self) -> &'static [(&'static str, &'static str)] {
        match self {
            // RFC 9110 §11.6.1: a 401 names the scheme it takes.
            ProxyError::Unauthorized => &[("WWW-Authenticate", "Bearer")],
            ProxyError::NoHealthyPeer => &[("Retry-After", "5")],
            // RFC 9110 §15.5.6: a 405 lists the methods the target takes.
            ProxyError::BadRequestHead(HeadError::MethodNotAllowed) => {
                &[("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")]
            }
            ProxyError::ShuttingDown { .. } => &[("Retry-After", "1")],
            ProxyError::ConcurrencyLimit(..) | ProxyError::LatencyShed { .. } => {
                &[("Retry-After", "1")]
            }
            _ => &[],
        }
    }

    /// Whether the connection must close after this answer (the request's body may not
    /// have been read, or the head could not be parsed).
    pub fn closes(&self) -> bool {
        matches!(
            self,
            ProxyError::BadRequestHead(_)
                | ProxyError::HeadTimeout
                | ProxyError::BodyTimeout
                | ProxyError::BodyTooLarge { .. }
                | ProxyError::BadChunkedBody
                | ProxyError::ClientGone
        )
    }

    pub fn body(&self, route: Option<&str>) -> Value {
        let mut err = Map::new();
        err.insert("type".into(), json!(self.kind()));
        err.insert("message".into(), json!(self.message()));
        if let Some(r) = route {
            err.insert("route".into(), json!(r));
        }
        match self {
            ProxyError::UnknownRoute { known } => {
                err.insert("routes".into(), json!(known));
            }
            ProxyError::BodyTooLarge { limit } => {
                err.insert("limit_bytes".into(), json!(limit));
            }
            ProxyError::RejectedByRule { rule, .. } => {
                err.insert("rule".into(), json!(rule));
            }
            ProxyError::LatencyShed {
                gate,
                ewma,
                threshold,
                names,
                healthy_peers,
                active_level,
                avg_5min,
            } => {
                let (model, metric) = &**names;
                err.insert("trigger".into(), json!(format!("{gate}_ewma")));
                err.insert(format!("{gate}_ewma"), json!((ewma * 10.0).round() / 10.0));
                err.insert(format!("{gate}_limit"), json!(threshold));
                err.insert("model".into(), json!(model.as_deref().unwrap_or("-")));
                err.insert("healthy_peers".into(), json!(healthy_peers));
                err.insert("active_level".into(), json!(active_level));
                err.insert("avg_5min".into(), json!(round1(*avg_5min)));
                err.insert("metric".into(), json!(metric));
            }
            ProxyError::ModelNotSupported { model, supported } => {
                err.insert("model".into(), json!(model));
                err.insert("supported_models".into(), json!(supported));
            }
            ProxyError::ConcurrencyLimit(f, prio, adaptive) => {
                err.insert(
                    "trigger".into(),
                    json!(format!("realtime_{}x", f.rt_factor)),
                );
                err.insert("limit".into(), limit_json(f.limit));
                err.insert("inflight".into(), json!(f.inflight));
                err.insert("rt_factor".into(), json!(f.rt_factor));
                err.insert("healthy_peers".into(), json!(f.healthy_peers));
                err.insert("active_level".into(), json!(f.active_level));
                err.insert("avg_5min".into(), json!(round1(f.avg_5min)));
                // As the reference names them: the adaptive limit in force, and the static
                // pool limit it moves under (only when the limit is the adaptive one).
                if let Some(pool_limit) = *adaptive {
                    err.insert("adaptive_cc".into(), limit_json(f.limit));
                    err.insert("pool_limit".into(), limit_json(pool_limit));
                }
                if let Some(&(bucket, min_turn, share, ceiling)) = prio.as_deref() {
                    err.insert("turn_bucket".into(), json!(bucket));
                    err.insert("bucket_min_turn".into(), json!(min_turn));
                    err.insert("share".into(), json!(share));
                    err.insert("bucket_limit".into(), limit_json(ceiling));
                }
            }
            _ => {}
        }
        json!({ "error": Value::Object(err) })
    }
}

/// One decimal, as the cluster average is shown.
fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// A limit as JSON: an integer when it is one (static limits), else the fraction the
/// adaptive controller holds, to two decimals.
pub fn limit_json(v: f64) -> Value {
    if v.fract() == 0.0 && v >= 0.0 && v < u64::MAX as f64 {
        json!(v as u64)
    } else if v.is_finite() {
        json!((v * 100.0).round() / 100.0)
    } else {
        json!(v)
    }
}

/// A complete response with a JSON body.
pub fn json_response(status: u16, body: &Value, extra: &[(&str, &str)], close: bool) -> Vec<u8> {
    json_response_with_lines(status, body, extra, &[], close)
}

/// [`json_response`] with `lines`, whole header lines ending in CRLF, after `extra`.
pub fn json_response_with_lines(
    status: u16,
    body: &Value,
    extra: &[(&str, &str)],
    lines: &[u8],
    close: bool,
) -> Vec<u8> {
    let body = serde_json::to_vec(body).unwrap_or_default();
    let mut out = Vec::with_capacity(160 + body.len());
    out.extend_from_slice(format!("HTTP/1.1 {status} {}\r\n", status_reason(status)).as_bytes());
    crate::http::push_date_header(&mut out);
    out.extend_from_slice(b"Content-Type: application/json\r\n");
    out.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    for (k, v) in extra {
        crate::http::write_header(&mut out, k.as_bytes(), v.as_bytes());
    }
    out.extend_from_slice(lines);
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

/// The length of a response's head, its blank line included (`None` without one).
pub fn head_len(resp: &[u8]) -> Option<usize> {
    resp.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
}

/// The answer to `head`'s request as it goes on the wire: a response to HEAD keeps its
/// status line and headers, `Content-Length` included, and drops its body (RFC 9110
/// §9.3.2). A client reading a body after a HEAD answer would take it for the next
/// response on the connection. An HTTP/1.0 connection kept open is told so.
pub fn for_request(head: &crate::http::RequestHead, mut resp: Vec<u8>) -> Vec<u8> {
    let Some(end) = head_len(&resp).map(|n| n - 4) else {
        return resp;
    };
    if head.method_bytes() == b"HEAD" {
        resp.truncate(end + 4);
    }
    // An HTTP/1.0 connection persists only when the answer says so (RFC 9112 §9.3 and
    // C.2.2): without `keep-alive` a 1.0 client (`ab -k`) reads this answer to the close
    // that never comes. A kept connection's answer has no `Connection: close`.
    if head.minor_version == 0 {
        let closes = resp[..end + 2]
            .windows(21)
            .any(|w| w == b"\r\nConnection: close\r\n");
        if !closes {
            resp.splice(end + 2..end + 2, *b"Connection: keep-alive\r\n");
        }
    }
    resp
}

/// A complete response with a plain-text body.
pub fn text_response(status: u16, body: &str, close: bool) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", status_reason(status)).into_bytes();
    crate::http::push_date_header(&mut out);
    out.extend_from_slice(
        format!(
            "Content-Type: text/plain\r\nContent-Length: {}\r\n{}\r\n",
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        )
        .as_bytes(),
    );
    out.extend_from_slice(body.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Static limits are integers; the adaptive controller's fractions are shown to two
    /// decimals (a 429 showed `11.061361903423922`).
    #[test]
    fn limits_are_integers_or_two_decimals() {
        assert_eq!(limit_json(8.0), json!(8));
        assert_eq!(limit_json(11.061361903423922), json!(11.06));
        assert_eq!(limit_json(0.5), json!(0.5));
    }

    #[test]
    fn shapes() {
        let e = ProxyError::UnknownRoute {
            known: vec!["a".into(), "b".into()],
        };
        assert_eq!(e.status(), 404);
        let b = e.body(None);
        assert_eq!(b["error"]["type"], "unknown_route");
        assert_eq!(b["error"]["routes"], json!(["a", "b"]));
        let r = json_response(
            503,
            &ProxyError::NoHealthyPeer.body(Some("r")),
            ProxyError::NoHealthyPeer.headers(),
            false,
        );
        let s = String::from_utf8(r).unwrap();
        assert!(s.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(s.contains("Retry-After: 5\r\n"));
        assert!(s.contains("\"route\":\"r\""));
        assert_eq!(
            ProxyError::BadRequestHead(HeadError::TooLarge).status(),
            431
        );
        assert!(ProxyError::BodyTooLarge { limit: 1 }.closes());
    }
}
