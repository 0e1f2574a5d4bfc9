//! HTTP/1.1 framing, pure: bytes in, decisions out, no IO.
//!
//! Reads request and response heads with `httparse`, decides how each message body is
//! framed (RFC 9112 §6), decodes chunked bodies incrementally and writes heads. Everything
//! here takes byte slices and returns values or errors; the IO shells live in `worker` and
//! `pipeline`. Client and peer bytes never panic this module: every malformed input is an
//! error value. `tests.rs` feeds them seeded random mutations of real heads and chunked
//! bodies and checks what a parse promises (no fuzzing harness: `cargo fuzz` needs a nightly
//! toolchain).

mod chunked;
mod head;
mod write;

#[cfg(test)]
mod tests;

pub use chunked::{encode_chunk, ChunkError, ChunkedDecoder};
pub use head::{
    parse_request, parse_response, BodyFraming, HeadError, HeadParse, Headers, Known, RequestHead,
    ResponseFraming, ResponseHead,
};
pub use write::{
    is_framing, is_hop_by_hop, name_is, push_date_header, push_decimal, push_status_line,
    status_reason, write_header,
};
