# syntax=docker/dockerfile:1
# Multi-stage build: a full Rust toolchain to build, a slim Debian to run.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The router is the profile-guided build (bench/pgo-build: trained against warmroute-mock under
# wrk, installing wrk and llvm-<rustc's LLVM> with apt-get); PGO=0, or a failed training, gives
# the plain build. A build sandbox without io_uring trains the epoll fallback only.
ARG PGO=1
RUN cargo build --release --locked --bin warmroute --bin warmroute-mock \
 && if [ "$PGO" = 1 ] && CARGO_TARGET_DIR=/src/target bench/pgo-build; then \
      cp target/pgo/warmroute target/release/warmroute; \
    else echo "PGO build skipped or failed: the plain build is used"; fi \
 && strip target/release/warmroute target/release/warmroute-mock

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 warmroute \
 && mkdir -p /etc/warmroute/routes && chown -R warmroute /etc/warmroute
COPY --from=build /src/target/release/warmroute /src/target/release/warmroute-mock /usr/local/bin/
COPY routes/example.toml /etc/warmroute/routes/example.toml
USER warmroute
WORKDIR /etc/warmroute
EXPOSE 8080 8090
# io_uring and seccomp: Docker's default seccomp profile (since Engine 25) and many
# Kubernetes runtimes block io_uring_setup/io_uring_enter/io_uring_register. warmroute then
# logs "io_uring unavailable ... epoll fallback" per worker and keeps working on epoll.
# To get io_uring, run with a seccomp profile that allows those three syscalls (or, for a
# test, --security-opt seccomp=unconfined). The shared segment lives in /dev/shm: give the
# container enough of it (--shm-size=64m is plenty; the segment is 15 MB up to 32 workers,
# 27 MB at 128).
# SIGQUIT drains gracefully (in-flight streams finish, up to drain_timeout_s).
STOPSIGNAL SIGQUIT
HEALTHCHECK --interval=10s --timeout=2s CMD curl -fsS http://127.0.0.1:8090/healthz || exit 1
ENTRYPOINT ["/usr/local/bin/warmroute"]
# With no server file every default applies and routes load from ./routes (/etc/warmroute/routes).
CMD ["serve"]
