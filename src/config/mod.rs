//! Configuration: the server file and the route files → one validated, immutable `Config`.
//!
//! Contract:
//! - Reads: the optional server file, every `*.toml` in the routes directory, and the
//!   environment variables `WARMROUTE_API_KEYS_FILE` and `BODYLOG_LISTENER_HOST`. Peer host
//!   names are resolved once here. Nothing else: no sockets, no shared memory.
//! - Decides: whether the configuration is valid. Every problem of every file is collected
//!   (with file and field) before returning, so one `warmroute check` shows all of them.
//! - Produces: `Config`, shared with workers as `Arc` snapshots; routes sorted by name.
//! - Never: applies anything, logs on its own, or keeps state between loads.
//!
//! Route options have one source of truth, `catalog::ROUTE_OPTS`: `RouteOpts` starts from
//! its defaults, the route file's values are checked against it, and `/_route_opts` renders it.

pub mod catalog;
mod route;
mod server;
mod value;

pub(crate) use value::near_key;
pub(crate) use value::type_name as toml_type_name;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use route::{
    is_ip_literal, resolve_all as resolve_peer_all, valid_route_name, AffinityHash, MetricSpec,
    PeerConfig, Pool, PrioBucket, RouteConfig, RouteOpts, DEFAULT_PEER_MAX_CONCURRENCY,
    MAX_METRICS, MAX_PEERS_PER_ROUTE,
};
pub use server::{
    default_shm_path, listen_conflict, BusyPoll, ServerConfig, ServerDefaults,
    DEFAULT_ADMIN_LISTEN, DEFAULT_LISTEN, DEFAULT_MAX_BODY_SIZE_CEILING, ENV_API_KEYS_FILE,
    ENV_BODYLOG_LISTENER,
};
pub use value::parse_size;

use value::Diag;

/// Most routes one configuration may hold (SPEC §14).
pub const MAX_ROUTES: usize = 1024;

/// One problem in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Dotted path of the offending key, e.g. `peers[1].port`; `(file)` for a file that
    /// cannot be read, `(toml)` for a syntax error.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}: {}",
            self.file.display(),
            self.field,
            self.message
        )
    }
}

impl std::error::Error for ConfigError {}

/// A loaded, validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    /// Sorted by name.
    pub routes: Vec<Arc<RouteConfig>>,
    pub server_file: Option<PathBuf>,
    /// Problems that did not stop loading (a default was applied instead); `warmroute check`
    /// reports them and fails.
    pub soft_errors: Vec<ConfigError>,
    pub warnings: Vec<ConfigError>,
}

impl Config {
    /// The route named `name`.
    pub fn route(&self, name: &str) -> Option<&Arc<RouteConfig>> {
        self.routes
            .binary_search_by(|r| r.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.routes[i])
    }

    /// The route serving `model` on the unprefixed `/v1` path.
    pub fn route_for_model(&self, model: &str) -> Option<&Arc<RouteConfig>> {
        self.routes
            .iter()
            .find(|r| r.models.iter().any(|m| m == model))
    }
}

/// Loads the optional server file (none → every default), then every `*.toml` in its
/// `routes_dir` (a relative `routes_dir` is taken from the server file's directory, or from
/// the current directory when there is no server file). A missing routes directory is an
/// error only when the server file names it. The environment overrides
/// `WARMROUTE_API_KEYS_FILE` and `BODYLOG_LISTENER_HOST` apply.
///
/// On failure, the list holds every error of every file, followed by the soft errors.
pub fn load(server_file: Option<&Path>) -> Result<Config, Vec<ConfigError>> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    load_with(server_file, &cwd, &|k| std::env::var(k).ok())
}

/// Like `load`, from text: the server file's text (or none) and `(route name, route text)`
/// pairs. Used by the embedded demo and by tests. The environment overrides apply.
pub fn load_from_strs(
    server: Option<&str>,
    routes: &[(&str, &str)],
) -> Result<Config, Vec<ConfigError>> {
    load_strs_with(server, routes, &|k| std::env::var(k).ok())
}

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A route file's name, path and text (or why it could not be read).
struct RouteSource {
    name: String,
    file: PathBuf,
    text: Result<String, String>,
}

fn load_strs_with(
    server: Option<&str>,
    routes: &[(&str, &str)],
    env: Env,
) -> Result<Config, Vec<ConfigError>> {
    let mut diags = Vec::new();
    let server_path = PathBuf::from("(embedded)/warmroute.toml");
    let (config, _) = read_server(
        &server_path,
        server.map(|t| Ok(t.to_string())),
        env,
        &mut diags,
    );
    let sources = routes
        .iter()
        .map(|(name, text)| RouteSource {
            name: name.to_string(),
            file: PathBuf::from(format!("(embedded)/{name}.toml")),
            text: Ok(text.to_string()),
        })
        .collect();
    let routes = build_routes(&config, sources, &mut diags);
    finish(config, routes, server.map(|_| server_path), diags)
}

fn load_with(server_file: Option<&Path>, cwd: &Path, env: Env) -> Result<Config, Vec<ConfigError>> {
    let mut diags = Vec::new();
    let (mut config, routes_dir_set) = match server_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"));
            read_server(path, Some(text), env, &mut diags)
        }
        None => read_server(Path::new("(none)"), None, env, &mut diags),
    };
    let base = match server_file.and_then(Path::parent) {
        Some(dir) if dir.as_os_str().is_empty() => cwd.to_path_buf(),
        Some(dir) if dir.is_relative() => cwd.join(dir),
        Some(dir) => dir.to_path_buf(),
        None => cwd.to_path_buf(),
    };
    if config.routes_dir.is_relative() {
        config.routes_dir = base.join(&config.routes_dir);
    }
    let mut dir_diag =
        Diag::new(server_file.map_or_else(|| config.routes_dir.clone(), Path::to_path_buf));
    let sources = match list_route_files(&config.routes_dir) {
        Ok((files, skipped)) => {
            for path in skipped {
                dir_diag.warn(
                    "routes_dir",
                    format!(
                        "{} is not a regular file (a directory, or a symlink to nothing): skipped",
                        path.display()
                    ),
                );
            }
            files
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !routes_dir_set => Vec::new(),
        Err(e) => {
            dir_diag.error(
                "routes_dir",
                format!("cannot read {}: {e}", config.routes_dir.display()),
            );
            Vec::new()
        }
    };
    diags.push(dir_diag);
    let routes = build_routes(&config, sources, &mut diags);
    finish(config, routes, server_file.map(Path::to_path_buf), diags)
}

/// Every `*.toml` regular file (symlinks followed, hidden files skipped) in `dir`, by name;
/// and the `*.toml` names that are not one (a directory, a dangling symlink), to warn of.
fn list_route_files(dir: &Path) -> std::io::Result<(Vec<RouteSource>, Vec<PathBuf>)> {
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'));
        let is_toml = path.extension().is_some_and(|e| e == "toml");
        if hidden || !is_toml {
            continue;
        }
        if !path.is_file() {
            skipped.push(path);
            continue;
        }
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read: {e}"));
        files.push(RouteSource {
            name,
            file: path,
            text,
        });
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    skipped.sort();
    Ok((files, skipped))
}

/// Parses the server file (`None` = no file) and records its problems.
fn read_server(
    path: &Path,
    text: Option<Result<String, String>>,
    env: Env,
    diags: &mut Vec<Diag>,
) -> (ServerConfig, bool) {
    let mut d = Diag::new(path);
    let table = match text {
        None => toml::Table::new(),
        Some(Err(e)) => {
            d.error("(file)", e);
            toml::Table::new()
        }
        Some(Ok(text)) => match text.parse::<toml::Table>() {
            Ok(t) => t,
            Err(e) => {
                d.syntax(&text, &e);
                toml::Table::new()
            }
        },
    };
    let parsed = server::parse_server(&table, env, &mut d);
    diags.push(d);
    (parsed.config, parsed.routes_dir_set)
}

/// Parses every route and checks what concerns several routes at once.
fn build_routes(
    server: &ServerConfig,
    mut sources: Vec<RouteSource>,
    diags: &mut Vec<Diag>,
) -> Vec<Arc<RouteConfig>> {
    sources.sort_by(|a, b| a.name.cmp(&b.name));
    let mut seen = std::collections::BTreeSet::new();
    let mut routes: BTreeMap<String, Arc<RouteConfig>> = BTreeMap::new();
    if sources.len() > MAX_ROUTES {
        let mut d = Diag::new(&server.routes_dir);
        d.error(
            "routes",
            format!("{} routes; at most {MAX_ROUTES} are allowed", sources.len()),
        );
        diags.push(d);
    }
    // Which route serves each model on the unprefixed /v1 path.
    let mut served: BTreeMap<String, String> = BTreeMap::new();
    for src in sources {
        let mut d = Diag::new(&src.file);
        let table = match &src.text {
            Err(e) => {
                d.error("(file)", e.clone());
                None
            }
            Ok(text) => match text.parse::<toml::Table>() {
                Ok(t) => Some(t),
                Err(e) => {
                    d.syntax(text, &e);
                    None
                }
            },
        };
        if !seen.insert(src.name.clone()) {
            d.error("name", format!("route {:?} is defined twice", src.name));
        } else if let Some(table) = table {
            if let Some(r) = route::parse_route(&src.name, src.file.clone(), &table, server, &mut d)
            {
                for m in &r.models {
                    match served.get(m) {
                        Some(other) => d.error(
                            "models",
                            format!("model {m:?} is also served by route {other:?}"),
                        ),
                        None => {
                            served.insert(m.clone(), r.name.clone());
                        }
                    }
                }
                routes.insert(r.name.clone(), Arc::new(r));
            }
        }
        diags.push(d);
    }
    routes.into_values().collect()
}

fn finish(
    server: ServerConfig,
    routes: Vec<Arc<RouteConfig>>,
    server_file: Option<PathBuf>,
    diags: Vec<Diag>,
) -> Result<Config, Vec<ConfigError>> {
    let mut errors = Vec::new();
    let mut soft_errors = Vec::new();
    let mut warnings = Vec::new();
    for mut d in diags {
        errors.append(&mut d.errors);
        soft_errors.append(&mut d.soft);
        warnings.append(&mut d.warnings);
    }
    if !errors.is_empty() {
        errors.append(&mut soft_errors);
        return Err(errors);
    }
    Ok(Config {
        server,
        routes,
        server_file,
        soft_errors,
        warnings,
    })
}
