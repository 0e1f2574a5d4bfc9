//! Dispatch: which route a request path names, and what the peer sees as its path.
//! Pure: takes the path and the route names, no IO.

use std::borrow::Cow;

use crate::bytescan::split_once_ascii;

/// Where a request goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Dispatch<'a> {
    /// Proxy to route `route` with upstream target `/<rest>` (query kept).
    Proxy {
        route: &'a str,
        target: Cow<'a, str>,
    },
    /// A route debug endpoint `/<route>/_<name>`.
    Debug { route: &'a str, endpoint: &'a str },
    /// A server-wide endpoint (admin port, or `/v1/models` without a route).
    Server { endpoint: &'a str },
    /// `/v1/...` without a route prefix: the body's `model` picks the route.
    Bare { target: &'a str },
    /// `/<name>/...` where `<name>` is no route.
    UnknownRoute { name: &'a str },
}

/// Split `/<route>/<rest>?query`. `is_route` tells which first segments are routes.
pub fn resolve<'a>(target: &'a str, is_route: impl Fn(&str) -> bool) -> Dispatch<'a> {
    let path = split_once_ascii(target, b'?').map_or(target, |(p, _)| p);
    let Some(trimmed) = path.strip_prefix('/') else {
        return Dispatch::UnknownRoute { name: "" };
    };
    let (first, rest) = match split_once_ascii(trimmed, b'/') {
        Some((f, r)) => (f, r),
        None => (trimmed, ""),
    };
    if is_route(first) {
        if let Some(ep) = rest.strip_prefix('_') {
            if !ep.as_bytes().contains(&b'/') {
                return Dispatch::Debug {
                    route: first,
                    endpoint: ep,
                };
            }
        }
        // The upstream target is the request target after `/<route>`: a borrowed suffix,
        // except for `/<route>` itself, which becomes `/`.
        let after = &target[1 + first.len()..];
        let t = if after.starts_with('/') {
            Cow::Borrowed(after)
        } else {
            Cow::Owned(format!("/{after}"))
        };
        return Dispatch::Proxy {
            route: first,
            target: t,
        };
    }
    match path {
        "/healthz" | "/readyz" | "/metrics" | "/_routes" | "/v1/models" => {
            Dispatch::Server { endpoint: path }
        }
        _ if first == "v1" => Dispatch::Bare { target },
        _ => Dispatch::UnknownRoute { name: first },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(t: &str) -> Dispatch<'_> {
        resolve(t, |n| n == "chat" || n == "v1.x")
    }

    #[test]
    fn routes_and_rewrites() {
        assert_eq!(
            r("/chat/v1/chat/completions"),
            Dispatch::Proxy {
                route: "chat",
                target: "/v1/chat/completions".into()
            }
        );
        assert_eq!(
            r("/chat/v1/models?a=1&b=2"),
            Dispatch::Proxy {
                route: "chat",
                target: "/v1/models?a=1&b=2".into()
            }
        );
        assert_eq!(
            r("/chat"),
            Dispatch::Proxy {
                route: "chat",
                target: "/".into()
            }
        );
        assert_eq!(
            r("/chat/"),
            Dispatch::Proxy {
                route: "chat",
                target: "/".into()
            }
        );
        assert_eq!(
            r("/chat?x"),
            Dispatch::Proxy {
                route: "chat",
                target: "/?x".into()
            }
        );
        assert_eq!(
            r("/v1.x/v1/completions"),
            Dispatch::Proxy {
                route: "v1.x",
                target: "/v1/completions".into()
            }
        );
    }

    #[test]
    fn debug_server_and_unknown() {
        assert_eq!(
            r("/chat/_active_conns"),
            Dispatch::Debug {
                route: "chat",
                endpoint: "active_conns"
            }
        );
        assert_eq!(
            r("/chat/_active_conns_set?flush=1"),
            Dispatch::Debug {
                route: "chat",
                endpoint: "active_conns_set"
            }
        );
        assert_eq!(
            r("/chat/_x/y"),
            Dispatch::Proxy {
                route: "chat",
                target: "/_x/y".into()
            }
        );
        assert_eq!(
            r("/healthz"),
            Dispatch::Server {
                endpoint: "/healthz"
            }
        );
        assert_eq!(r("/nope/v1/x"), Dispatch::UnknownRoute { name: "nope" });
        assert_eq!(
            r("/v1/chat/completions?a=1"),
            Dispatch::Bare {
                target: "/v1/chat/completions?a=1"
            }
        );
        assert_eq!(
            r("/v1/models"),
            Dispatch::Server {
                endpoint: "/v1/models"
            }
        );
        assert_eq!(r("/"), Dispatch::UnknownRoute { name: "" });
    }
}
