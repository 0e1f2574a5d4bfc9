//! The immutable view a worker serves from: validated config plus the segment slots of
//! every route and peer.
//!
//! Built once per (re)load on the main thread, sent to every worker as an `Arc`, swapped
//! by each worker between requests. A request keeps the `Arc` it started with, so a reload
//! never changes a request in flight. Slots are keyed by route, pool and peer address, so a
//! peer that survives a reload keeps its in-flight count, bans and counters.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;

use warmroute_shm::{PeerSlot, RouteSlot, Segment};

use crate::auth::{KeyFile, KeyTable};
use crate::config::{Config, RouteConfig};
use crate::pipeline::peer_select::{
    fnv1a64, fnv1a64_extend, mix64, Affinity, Load, FNV1A64_OFFSET,
};

/// One backend of one pool, as the data path needs it.
#[derive(Debug)]
pub struct PeerRt {
    pub name: String,
    pub addr: SocketAddr,
    /// `Host` header value sent to this peer.
    pub host_header: String,
    pub priority: i32,
    pub max_concurrency: u32,
    pub slot: PeerSlot,
    /// Per-peer probe path override.
    pub probe: Option<String>,
    /// Stable hash of the address, for rendezvous selection.
    pub key_hash: u64,
}

impl PeerRt {
    fn new(p: &crate::config::PeerConfig, slot: PeerSlot) -> PeerRt {
        PeerRt {
            name: p.name.clone(),
            addr: p.addr,
            host_header: if p.port == 80 {
                p.host.clone()
            } else {
                format!("{}:{}", p.host, p.port)
            },
            priority: p.priority,
            max_concurrency: p.max_concurrency,
            slot,
            probe: p.probe.clone(),
            key_hash: crate::pipeline::peer_select::fnv1a64(p.addr.to_string().as_bytes()),
        }
    }
}

/// A pool: the flat `peers` list, or one `peers_by_model` entry.
#[derive(Debug)]
pub struct PoolRt {
    pub model: Option<String>,
    pub peers: Vec<PeerRt>,
    /// The pool's measurement and control state in the segment.
    pub slots: crate::control::pool_state::PoolSlots,
}

impl PoolRt {
    /// Route `route`'s pool `pool` as a running router keeps it in `seg`, looked up without
    /// taking a slot (for `warmroute status`, which must not write to a router's
    /// segment); `None` when the segment has no state for it.
    pub fn find(seg: &Segment, route: &str, pool: &crate::config::Pool) -> Option<PoolRt> {
        let model = pool.model.as_deref();
        let peers = pool
            .peers
            .iter()
            .map(|p| {
                let slot = seg.find_peer_slot(&peer_key(route, model, p.addr))?;
                Some(PeerRt::new(p, slot))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(PoolRt {
            model: pool.model.clone(),
            peers,
            slots: crate::control::pool_state::PoolSlots::find(seg, route, model)?,
        })
    }

    /// Each peer's load and health as selection sees it, read from the segment.
    pub fn loads(&self, seg: &Segment, now_ms: u64) -> Vec<Load> {
        let mut v = Vec::with_capacity(self.peers.len());
        self.loads_into(seg, now_ms, &mut v);
        v
    }

    /// [`Self::loads`] into `out` (cleared first), reusing its allocation.
    pub fn loads_into(&self, seg: &Segment, now_ms: u64, out: &mut Vec<Load>) {
        out.clear();
        out.extend(self.peers.iter().map(|p| Load {
            inflight: seg.inflight(p.slot),
            max_concurrency: p.max_concurrency,
            healthy: !seg.is_banned(p.slot, now_ms),
            priority: p.priority,
            key_hash: p.key_hash,
        }));
    }

    /// Under `sticky_table` and with a session id: the session's key in the segment's
    /// placement table (the id within this pool) and the index of the peer the table holds
    /// for it, if it holds one and that peer is still in this pool (peers are recorded by
    /// address hash, so reloads that reorder or drop peers cannot point a session at the
    /// wrong one). `None` for the other algorithms or without an id.
    pub fn placement(
        &self,
        seg: &Segment,
        algo: Affinity,
        sid: Option<&[u8]>,
        now_s: u64,
    ) -> Option<(u64, Option<usize>)> {
        let sid = sid.filter(|_| algo == Affinity::Table)?;
        let key = mix64(fnv1a64(sid) ^ mix64(u64::from(self.slots.ctl.0) + 1));
        let peer = seg
            .session_peer(key, now_s)
            .and_then(|tag| self.peers.iter().position(|p| p.key_hash as u32 == tag));
        Some((key, peer))
    }

    /// Record that the session of `key` now lives on peer `i`.
    pub fn place_session(&self, seg: &Segment, key: u64, i: usize, now_s: u64) {
        seg.set_session_peer(key, self.peers[i].key_hash as u32, now_s);
    }
}

/// A route with its pools and slots.
#[derive(Debug)]
pub struct RouteRt {
    pub cfg: Arc<RouteConfig>,
    pub slot: RouteSlot,
    pub pools: Vec<PoolRt>,
    /// Keys this route accepts: its own `api_keys`, else the key file's. Empty = open.
    pub keys: Arc<KeyTable>,
    /// Every model this route serves, sorted (sub-pool keys and `models`).
    pub models_sorted: Vec<String>,
    /// Session turn priority: the route's state slot and its bucket table, resolved once.
    pub prio_slot: RouteSlot,
    pub prio_table: Vec<crate::config::PrioBucket>,
    /// Responses by status class (`cells::status`): a slot of its own, keyed
    /// `<route>#status`.
    pub status_slot: RouteSlot,
    /// The hit counter of each reject rule, by the rule's index (`cells::rule_slot_key`);
    /// `None` when the segment had no free slot (the hits then go uncounted).
    pub rule_slots: Vec<Option<RouteSlot>>,
    /// The switches and overrides set for the whole route at runtime, for the pools a
    /// reload adds (`pool_state::seed_from_route_wide`).
    pub wide: RouteSlot,
}

impl RouteRt {
    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// Every route slot this route's requests and tasks write: its own, its status, turn
    /// priority and rule rows, and its pools' state rows. What the worker stamps as in use
    /// (`WorkerCtx::touch_slots`).
    pub fn route_slots(&self) -> impl Iterator<Item = RouteSlot> + '_ {
        [self.slot, self.status_slot, self.prio_slot]
            .into_iter()
            .chain([self.wide])
            .chain(self.rule_slots.iter().flatten().copied())
            .chain(
                self.pools
                    .iter()
                    .flat_map(|p| [p.slots.ttft, p.slots.tps, p.slots.ctl]),
            )
    }

    /// The pool for a request: the flat pool, or the `peers_by_model` pool of `model`.
    pub fn pool_for(&self, model: Option<&str>) -> Option<&PoolRt> {
        match self.pools.as_slice() {
            [only] if only.model.is_none() => Some(only),
            pools => model.and_then(|m| pools.iter().find(|p| p.model.as_deref() == Some(m))),
        }
    }

    pub fn by_model(&self) -> bool {
        self.pools.iter().any(|p| p.model.is_some())
    }

    /// Every peer of every pool.
    pub fn all_peers(&self) -> impl Iterator<Item = &PeerRt> {
        self.pools.iter().flat_map(|p| p.peers.iter())
    }
}

/// Everything a worker reads to serve requests.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Arc<Config>,
    pub keys: Arc<KeyFile>,
    pub routes: Vec<Arc<RouteRt>>,
    by_name: HashMap<String, usize, BuildHasherDefault<NameHasher>>,
    pub generation: u64,
    /// Every key owner of the key file and the routes' own tables, sorted, with its row
    /// of counters in the segment (`cells::owner`). Owners without a name are left out.
    pub owners: Vec<(String, RouteSlot)>,
    /// A digest of the routes and their peers' segment slots ([`routes_digest`]), which
    /// each worker writes into its segment row: routers sharing a segment can tell whether
    /// they serve the same routes.
    pub routes_digest: u64,
}

/// A digest of `routes`: each route's name, its options (keys left out) and its peers'
/// segment slots and settings, in name and slot order. Two routers with the same route
/// files on one segment get the same value (the slots are the segment's, keyed by route,
/// pool and address, and the options print the same: their maps are ordered); never 0
/// (0 = not said).
pub fn routes_digest(routes: &[Arc<RouteRt>]) -> u64 {
    let mut named: Vec<&RouteRt> = routes.iter().map(|r| r.as_ref()).collect();
    named.sort_by(|a, b| a.name().cmp(b.name()));
    let mut h = crc32fast::Hasher::new();
    for r in named {
        h.update(r.name().as_bytes());
        h.update(&[0]);
        let mut opts = r.cfg.opts.clone();
        opts.api_keys = None;
        opts.upstream_api_key = None;
        h.update(format!("{opts:?}").as_bytes());
        let mut peers: Vec<&PeerRt> = r.all_peers().collect();
        peers.sort_by_key(|p| p.slot.0);
        for p in peers {
            h.update(&p.slot.0.to_le_bytes());
            h.update(&p.max_concurrency.to_le_bytes());
            h.update(&p.priority.to_le_bytes());
            h.update(p.probe.as_deref().unwrap_or("").as_bytes());
            h.update(&[0]);
        }
        h.update(&[0xff]);
    }
    u64::from(h.finalize()) | 1 << 32
}

/// The segment key of a peer slot: route, pool and address. Keys longer than the segment
/// allows are shortened to a prefix plus a checksum of the whole key.
pub fn peer_key(route: &str, model: Option<&str>, addr: SocketAddr) -> String {
    let key = format!("{route}/{}/{addr}", model.unwrap_or(""));
    shorten_key(key)
}

pub(crate) fn shorten_key(key: String) -> String {
    const MAX: usize = 119;
    if key.len() <= MAX {
        return key;
    }
    let sum = crc32fast::hash(key.as_bytes());
    let mut cut = MAX - 9;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}#{sum:08x}", &key[..cut])
}

/// Why a snapshot cannot be built: the segment's peer (`peer`) or route table has no free
/// slot for `what`. Says how full the table is and what frees slots.
fn full(seg: &Segment, peer: bool, what: &str) -> String {
    let (peers, routes) = seg.slots_taken();
    let caps = seg.caps();
    let (table, taken, cap) = if peer {
        ("peer", peers, caps.peers)
    } else {
        ("route", routes, caps.routes)
    };
    format!(
        "shared segment has no free {table} slot for {what} ({taken} of {cap} taken). \
         The slots of peers and routes that no configuration uses any more are freed once \
         nothing has used them for 10 s: retry the reload then."
    )
}

impl Snapshot {
    /// Resolve every route and peer to its segment slot.
    pub fn build(
        config: Arc<Config>,
        keys: Arc<KeyFile>,
        seg: &Segment,
        generation: u64,
    ) -> Result<Snapshot, String> {
        let mut routes = Vec::with_capacity(config.routes.len());
        let mut by_name =
            HashMap::with_capacity_and_hasher(config.routes.len(), Default::default());
        for rc in &config.routes {
            let slot = seg
                .route_slot(&shorten_key(rc.name.clone()))
                .ok_or_else(|| full(seg, false, &format!("route {}", rc.name)))?;
            let wide = crate::control::pool_state::wide_slot(seg, &rc.name)
                .ok_or_else(|| full(seg, false, &format!("the state of route {}", rc.name)))?;
            let mut pools = Vec::with_capacity(rc.pools.len());
            for pool in &rc.pools {
                let mut peers = Vec::with_capacity(pool.peers.len());
                for p in &pool.peers {
                    let key = peer_key(&rc.name, pool.model.as_deref(), p.addr);
                    let slot = seg
                        .peer_slot(&key)
                        .ok_or_else(|| full(seg, true, &format!("peer {key}")))?;
                    peers.push(PeerRt::new(p, slot));
                }
                let slots = crate::control::pool_state::PoolSlots::new(
                    seg,
                    &rc.name,
                    pool.model.as_deref(),
                )
                .ok_or_else(|| full(seg, false, &format!("the state of route {}", rc.name)))?;
                crate::control::pool_state::seed_from_route_wide(seg, &slots, wide);
                pools.push(PoolRt {
                    model: pool.model.clone(),
                    peers,
                    slots,
                });
            }
            let route_keys = match &rc.opts.api_keys {
                Some(t) => Arc::new(KeyTable::from_pairs(
                    t.iter().map(|(k, o)| (k.clone(), o.clone())),
                )),
                None => keys.table.clone(),
            };
            let mut models_sorted: Vec<String> = rc.models.clone();
            models_sorted.extend(pools.iter().filter_map(|p| p.model.clone()));
            models_sorted.sort();
            models_sorted.dedup();
            by_name.insert(rc.name.clone(), routes.len());
            routes.push(RouteRt {
                cfg: rc.clone(),
                slot,
                pools,
                keys: route_keys,
                models_sorted,
                prio_slot: crate::control::prio_state::slot(seg, &rc.name)
                    .ok_or_else(|| full(seg, false, &format!("the state of route {}", rc.name)))?,
                prio_table: crate::control::prio_state::table(&rc.opts),
                status_slot: crate::cells::status::slot(seg, &rc.name).ok_or_else(|| {
                    full(
                        seg,
                        false,
                        &format!("the status counts of route {}", rc.name),
                    )
                })?,
                rule_slots: Vec::new(),
                wide,
            });
        }
        // The rules' hit counters, resolved here rather than at a rule's first hit (an
        // insert takes the slot table's lock, which the data path never does), and after
        // every route's own rows: a configuration with many rules is never refused for
        // want of a slot, its rules' hits go uncounted instead.
        let mut uncounted = 0usize;
        for route in &mut routes {
            let rules = &route.cfg.opts.reject_rules_compiled.rules;
            route.rule_slots = rules
                .iter()
                .map(|r| {
                    let slot = seg.route_slot(&crate::cells::rule_slot_key(route.name(), &r.name));
                    uncounted += usize::from(slot.is_none());
                    slot
                })
                .collect();
        }
        if uncounted > 0 {
            tracing::warn!(
                rules = uncounted,
                "shared segment has no free row for the hit counters of these reject rules; their hits go uncounted"
            );
        }
        let routes: Vec<Arc<RouteRt>> = routes.into_iter().map(Arc::new).collect();
        let mut names: Vec<String> = routes
            .iter()
            .flat_map(|r| r.keys.owners())
            .filter(|o| !o.is_empty())
            .map(String::from)
            .collect();
        names.sort_unstable();
        names.dedup();
        let owners = names
            .into_iter()
            .filter_map(|o| {
                let slot = seg.route_slot(&shorten_key(format!("owner:{o}")));
                if slot.is_none() {
                    tracing::warn!(owner = %o, "shared segment has no free row for this owner's counters");
                }
                Some((o, slot?))
            })
            .collect();
        let routes_digest = routes_digest(&routes);
        Ok(Snapshot {
            config,
            keys,
            routes,
            by_name,
            generation,
            owners,
            routes_digest,
        })
    }

    /// The counters row of a key owner.
    pub fn owner_slot(&self, owner: &str) -> Option<RouteSlot> {
        self.owners
            .binary_search_by(|(o, _)| o.as_str().cmp(owner))
            .ok()
            .map(|i| self.owners[i].1)
    }

    pub fn route(&self, name: &str) -> Option<&Arc<RouteRt>> {
        self.by_name.get(name).map(|&i| &self.routes[i])
    }

    /// The route serving `model` (for requests without a route prefix).
    pub fn route_for_model(&self, model: &str) -> Option<&Arc<RouteRt>> {
        self.routes
            .iter()
            .find(|r| r.models_sorted.iter().any(|m| m == model))
    }

    /// The models a request without a route prefix may see, sorted, each with its route:
    /// those of the routes whose keys let `headers` in (SPEC §3.4: the key comes first).
    /// `None` when routes serve models but the request's key opens none of them (401).
    pub fn models_for(&self, headers: &crate::http::Headers) -> Option<Vec<(&str, &str)>> {
        let mut any = false;
        let mut models: Vec<(&str, &str)> = Vec::new();
        for r in self.routes.iter().filter(|r| !r.models_sorted.is_empty()) {
            any = true;
            if crate::auth::authorize(headers, &r.keys) != crate::auth::AuthDecision::Denied {
                models.extend(r.models_sorted.iter().map(|m| (m.as_str(), r.name())));
            }
        }
        if any && models.is_empty() {
            return None;
        }
        models.sort();
        Some(models)
    }

    pub fn route_names(&self) -> Vec<&str> {
        self.routes.iter().map(|r| r.name()).collect()
    }
}

/// FNV-1a for the route-name map, looked up twice per request: names are short and come
/// from the config (nothing for a client to flood), and SipHash's setup cost more than the
/// lookup itself.
pub struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        NameHasher(FNV1A64_OFFSET)
    }
}

impl Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = fnv1a64_extend(self.0, bytes);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_keys_are_shortened_but_distinct() {
        let a = peer_key(
            &"r".repeat(100),
            Some(&"m".repeat(50)),
            "127.0.0.1:1".parse().unwrap(),
        );
        let b = peer_key(
            &"r".repeat(100),
            Some(&"m".repeat(51)),
            "127.0.0.1:1".parse().unwrap(),
        );
        assert!(a.len() <= 119 && b.len() <= 119);
        assert_ne!(a, b);
        let short = peer_key("chat", None, "10.0.0.1:8000".parse().unwrap());
        assert_eq!(short, "chat//10.0.0.1:8000");
    }

    /// A segment of `peers` and `routes` slots in a file of its own (the caller removes it).
    fn unit_segment(tag: &str, peers: u32, routes: u32) -> (Segment, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "warmroute-snapshot-unit-{}-{tag}",
            std::process::id()
        ));
        let caps = warmroute_shm::Capacities {
            workers: 2,
            peers,
            routes,
        };
        (Segment::open_or_create(&path, caps).unwrap(), path)
    }

    /// A configuration with more reject rules than free route slots still builds: every
    /// route gets its own rows first, and the rules left over go uncounted.
    #[test]
    fn rules_never_take_the_slots_routes_need() {
        let (seg, path) = unit_segment("rules", 16, 16);
        let peers =
            "peers = [ { host = \"127.0.0.1\", port = 8001 } ]\nreject_rules_enabled = true\n";
        let mut many = String::from(peers);
        for k in 0..8 {
            many.push_str(&format!(
                "[[reject_rules]]\nname = \"r{k}\"\nfield = \"model\"\nop = \"eq\"\nvalue = \"m{k}\"\n"
            ));
        }
        // "a" (7 rows, 8 rules) sorts before "b" (7 rows): 22 rows wanted, 16 there.
        let cfg = crate::config::load_from_strs(None, &[("a", many.as_str()), ("b", peers)])
            .unwrap_or_else(|e| panic!("config: {e:?}"));
        let keys = Arc::new(crate::auth::load_key_file(None));
        let snap = Snapshot::build(Arc::new(cfg), keys, &seg, 1);
        let _ = std::fs::remove_file(&path);
        let snap = snap.expect("the routes' own rows come first");
        let a = snap.route("a").unwrap();
        assert_eq!(a.rule_slots.len(), 8);
        assert_eq!(a.rule_slots.iter().filter(|s| s.is_some()).count(), 2);
        assert!(snap.route("b").unwrap().rule_slots.is_empty());
        assert_eq!(seg.slots_taken().1, 16);
    }

    /// The same route files give the same digest, whatever order they load in; another
    /// option, peer setting or key-free change gives another; the keys do not count.
    #[test]
    fn the_routes_digest_follows_routes_options_and_peers_but_not_keys() {
        let (seg, path) = unit_segment("digest", 16, 64);
        let digest = |routes: &[(&str, &str)]| {
            let cfg = crate::config::load_from_strs(None, routes)
                .unwrap_or_else(|e| panic!("config: {e:?}"));
            let keys = Arc::new(crate::auth::load_key_file(None));
            Snapshot::build(Arc::new(cfg), keys, &seg, 1)
                .unwrap()
                .routes_digest
        };
        let peer = "peers = [ { host = \"127.0.0.1\", port = 8001 } ]\n";
        let base = digest(&[("a", peer), ("b", peer)]);
        assert_ne!(base, 0);
        assert_eq!(digest(&[("b", peer), ("a", peer)]), base);
        assert_ne!(digest(&[("a", peer)]), base);
        let slower = format!("{peer}health_check_interval = 30\n");
        assert_ne!(digest(&[("a", peer), ("b", slower.as_str())]), base);
        let limited = "peers = [ { host = \"127.0.0.1\", port = 8001, max_concurrency = 3 } ]\n";
        assert_ne!(digest(&[("a", peer), ("b", limited)]), base);
        let keyed = format!("{peer}api_keys = {{ owner = \"sk-1\" }}\n");
        let rekeyed = format!("{peer}api_keys = {{ owner = \"sk-2\" }}\n");
        assert_eq!(
            digest(&[("a", peer), ("b", keyed.as_str())]),
            digest(&[("a", peer), ("b", rekeyed.as_str())])
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn route_names_hash_as_fnv1a() {
        let mut h = NameHasher::default();
        h.write(b"chat");
        assert_eq!(h.finish(), crate::pipeline::peer_select::fnv1a64(b"chat"));
        let mut m: HashMap<String, usize, BuildHasherDefault<NameHasher>> = HashMap::default();
        for i in 0..500 {
            m.insert(format!("route-{i}"), i);
        }
        assert!((0..500).all(|i| m.get(format!("route-{i}").as_str()) == Some(&i)));
        assert_eq!(m.get("route-500"), None);
    }
}
