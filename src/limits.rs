//! Every fixed bound of the data plane, in one place, each with the reason it exists.
//!
//! Route-configurable limits (body size, timeouts) live in the option catalog; these are
//! the ones a client or a peer must never be able to push past.

/// Largest request head (request line + headers) we buffer: 64 KiB, SPEC §14. Beyond it → 431.
pub const REQUEST_HEAD_BYTES_MAX: usize = 64 * 1024;
/// Most request headers we parse: SPEC §14. Beyond it → 431.
pub const REQUEST_HEADERS_MAX: usize = 100;
/// Largest response head from a peer; a peer sending more is broken → 502.
pub const RESPONSE_HEAD_BYTES_MAX: usize = 64 * 1024;
/// Most response headers from a peer.
pub const RESPONSE_HEADERS_MAX: usize = 128;
/// Longest chunk-size line (hex digits + extensions) accepted in a chunked body.
pub const CHUNK_LINE_BYTES_MAX: usize = 4096;
/// Total bytes of trailers accepted after the last chunk.
pub const CHUNK_TRAILER_BYTES_MAX: usize = 16 * 1024;
/// Read buffer per client connection for heads; grows up to the head limit only when needed.
pub const CLIENT_READ_BUF_BYTES: usize = 8 * 1024;
/// Read size for relaying a response body: one client write per read of at most this.
pub const RELAY_READ_BUF_BYTES: usize = 16 * 1024;
/// The bytes a request body's first buffer is asked for, at most: a longer body's buffer
/// grows (doubling) as its bytes arrive, so a head that declares a large `Content-Length` and
/// sends nothing more holds about this much, not `max_body_size`. (The buffer itself can be
/// larger: `SpareBodies::take` adds the usage member's room and rounds a pooled size up to a
/// power of two, 128 KiB here, or lends a kept spare of up to 1 MiB.)
pub const BODY_BUF_FIRST_BYTES: usize = 64 * 1024;
/// Bytes of a session id used for hashing (SPEC §14).
pub const SESSION_ID_HASH_BYTES_MAX: usize = 4096;
/// Bodies up to this are sent in the same write as the upstream request head.
pub const INLINE_BODY_BYTES_MAX: usize = 16 * 1024;
/// 1xx interim responses relayed for one request before the peer is declared broken.
pub const INTERIM_RESPONSES_MAX: usize = 8;
