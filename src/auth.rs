//! API keys (SPEC §7): the key table, the key file, and the per-request decision.
//!
//! Contract:
//! - A key file holds `key:owner` entries separated by commas and/or newlines. Blank lines and
//!   lines starting with `#` are ignored; the entry splits at the first `:`; both parts are
//!   trimmed; an empty key is skipped; a missing or empty owner becomes `unnamed`; for a
//!   duplicated key the last entry wins. So an entry that begins with `:` (`:alice`, a key
//!   left out by mistake) is skipped. The reference's Lua takes such an entry as a key as
//!   it stands, which would let `Bearer :alice` in; this is kept the safer way on purpose
//!   while other keys remain. A file of nothing but such entries holds no key and is read
//!   as an empty file: at start-up the routes without their own `api_keys` are then open
//!   (fail-open, logged as an error), `check` fails on it, and a reload that finds it so
//!   keeps the keys it had before.
//! - A request presents `Authorization: Bearer <key>` or else `x-api-key: <key>`.
//! - An empty table means auth is off for the route (fail-open); otherwise the presented key
//!   must be in the table, compared in constant time with respect to key contents.
//! - Keys never leave this module: `Debug`, `owners()` and logs show owners only.
//!
//! Everything here is pure apart from `load_key_file` and `file_stamp`, which read the disk.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::http::Headers;

/// Owner given to an entry without one.
const UNNAMED: &str = "unnamed";

/// What loading the key file found; `key_file_status` in `/_health_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyFileStatus {
    /// At least one usable key.
    Ok,
    /// The file does not exist (ENOENT).
    Missing,
    /// The file exists but could not be read or is not UTF-8.
    Unreadable,
    /// Readable, but without a usable entry.
    Empty,
    /// No path configured.
    Unset,
}

impl KeyFileStatus {
    pub fn as_str(&self) -> &'static str {
        match self {
            KeyFileStatus::Ok => "ok",
            KeyFileStatus::Missing => "missing",
            KeyFileStatus::Unreadable => "unreadable",
            KeyFileStatus::Empty => "empty",
            KeyFileStatus::Unset => "unset",
        }
    }
}

/// An immutable set of keys → owners. Cheap to share in an Arc; built at load/reload, never
/// mutated.
#[derive(Clone, Default)]
pub struct KeyTable {
    /// Sorted by key, keys unique and non-empty.
    entries: Vec<(Box<[u8]>, String)>,
}

impl fmt::Debug for KeyTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyTable")
            .field("keys", &self.entries.len())
            .field("owners", &self.owners())
            .finish()
    }
}

impl KeyTable {
    /// Parse key-file text (see the module contract).
    pub fn parse(text: &str) -> KeyTable {
        // A byte-order mark (a file saved by Notepad) is not part of the first key.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut map = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            for entry in line.split(',') {
                let (key, owner) = match entry.split_once(':') {
                    Some((k, o)) => (k, o),
                    None => (entry, ""),
                };
                insert(&mut map, key, owner);
            }
        }
        KeyTable::from_map(map)
    }

    /// A route's inline `api_keys` table (key → owner), under the same trimming rules as the file.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, String)>) -> KeyTable {
        let mut map = BTreeMap::new();
        for (key, owner) in pairs {
            insert(&mut map, &key, &owner);
        }
        KeyTable::from_map(map)
    }

    fn from_map(map: BTreeMap<String, String>) -> KeyTable {
        KeyTable {
            entries: map
                .into_iter()
                .map(|(k, o)| (k.into_bytes().into_boxed_slice(), o))
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The owner of `candidate`, if it is a key of this table.
    ///
    /// Constant-time with respect to key contents: the candidate is compared with every stored
    /// key, each comparison runs over all of the candidate's bytes without returning early, and
    /// the matching index is selected with masks rather than branches. The running time depends
    /// only on the table size and the candidate's length, both of which the caller knows.
    pub fn owner_of(&self, candidate: &[u8]) -> Option<&str> {
        let mut found: usize = 0; // all ones once a key matched
        let mut index: usize = 0;
        for (i, (key, _)) in self.entries.iter().enumerate() {
            let eq = std::hint::black_box(ct_eq(key, candidate));
            // eq is 0 or 1; mask is all zeros or all ones.
            let mask = 0usize.wrapping_sub(eq);
            index = (index & !mask) | (i & mask);
            found |= mask;
        }
        if std::hint::black_box(found) != 0 {
            Some(self.entries[index].1.as_str())
        } else {
            None
        }
    }

    /// Owners, sorted and deduplicated (for status endpoints; never the keys).
    pub fn owners(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.iter().map(|(_, o)| o.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Changes when the set of key/owner pairs changes: FNV-1a 64 over the sorted `key=owner,`
    /// pairs. For change detection inside the process; it is not a secure hash, so do not
    /// publish it.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |bytes: &[u8]| {
            for &b in bytes {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        for (k, o) in &self.entries {
            feed(k);
            feed(b"=");
            feed(o.as_bytes());
            feed(b",");
        }
        h
    }
}

fn insert(map: &mut BTreeMap<String, String>, key: &str, owner: &str) {
    let key = key.trim();
    if key.is_empty() {
        return;
    }
    let owner = owner.trim();
    let owner = if owner.is_empty() { UNNAMED } else { owner };
    map.insert(key.to_string(), owner.to_string());
}

/// 1 if `stored == candidate`, else 0, in time that depends only on `candidate.len()`.
/// `stored` is never empty (empty keys are skipped at parse time).
fn ct_eq(stored: &[u8], candidate: &[u8]) -> usize {
    let mut diff: usize = stored.len() ^ candidate.len();
    let len = stored.len();
    for (i, &c) in candidate.iter().enumerate() {
        // Past the end of `stored`, read byte 0 and mask it away; the length check above
        // already makes the result unequal. No branch on content.
        let in_range = usize::from(i < len);
        let s = stored[i * in_range] & 0u8.wrapping_sub(in_range as u8);
        diff |= usize::from(s ^ c);
    }
    let diff = std::hint::black_box(diff);
    // 1 when diff == 0, else 0, without a branch.
    1 ^ ((diff | diff.wrapping_neg()) >> (usize::BITS - 1))
}

/// The key file as last loaded.
#[derive(Debug, Clone)]
pub struct KeyFile {
    pub path: Option<PathBuf>,
    /// What the file itself gave at the last read.
    pub status: KeyFileStatus,
    /// The keys in force. Normally the file's; see `kept_previous`.
    pub table: Arc<KeyTable>,
    /// The file was read with keys before and now reads empty or unreadable: `table` holds
    /// the keys of that earlier read, still in force (an emptied file does not open every
    /// route), while `status` says what the file holds now.
    pub kept_previous: bool,
    /// Taken before the read, so a change racing the read shows up on the next poll.
    pub stamp: FileStamp,
}

/// Read the key file. Missing (ENOENT) → Missing; other read errors (permission, is a
/// directory, invalid UTF-8) → Unreadable; no usable entry → Empty.
pub fn load_key_file(path: Option<&Path>) -> KeyFile {
    let Some(path) = path else {
        return KeyFile {
            path: None,
            status: KeyFileStatus::Unset,
            table: Arc::new(KeyTable::default()),
            kept_previous: false,
            stamp: FileStamp::missing(),
        };
    };
    let stamp = file_stamp(path);
    let (status, table) = match std::fs::read(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            (KeyFileStatus::Missing, KeyTable::default())
        }
        Err(_) => (KeyFileStatus::Unreadable, KeyTable::default()),
        Ok(bytes) => match String::from_utf8(bytes) {
            Err(_) => (KeyFileStatus::Unreadable, KeyTable::default()),
            Ok(text) => {
                let table = KeyTable::parse(&text);
                if table.is_empty() {
                    (KeyFileStatus::Empty, table)
                } else {
                    (KeyFileStatus::Ok, table)
                }
            }
        },
    };
    KeyFile {
        path: Some(path.to_path_buf()),
        status,
        table: Arc::new(table),
        kept_previous: false,
        stamp,
    }
}

/// What identifies a file's current content on disk, for change polling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    state: StampState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum StampState {
    /// The path (or a link on the way) does not exist.
    Missing,
    /// It exists but could not be examined.
    Failed(io::ErrorKind),
    Present {
        canonical: PathBuf,
        dev: u64,
        ino: u64,
        size: u64,
        mtime_nanos: i128,
    },
}

impl FileStamp {
    fn missing() -> FileStamp {
        FileStamp {
            state: StampState::Missing,
        }
    }

    /// Whether the file existed and could be examined when stamped.
    pub fn exists(&self) -> bool {
        matches!(self.state, StampState::Present { .. })
    }
}

/// Stamp `path`, following symlinks (a Kubernetes secret swaps its `..data` symlink): the
/// target's (device, inode, size, mtime in nanoseconds) plus the canonical path. A missing file
/// gives a distinct value.
pub fn file_stamp(path: &Path) -> FileStamp {
    let failed = |e: io::Error| FileStamp {
        state: if e.kind() == io::ErrorKind::NotFound {
            StampState::Missing
        } else {
            StampState::Failed(e.kind())
        },
    };
    let canonical = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) => return failed(e),
    };
    let meta = match std::fs::metadata(&canonical) {
        Ok(m) => m,
        Err(e) => return failed(e),
    };
    FileStamp {
        state: StampState::Present {
            canonical,
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_nanos: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        },
    }
}

/// The credential a request presents: `Authorization: Bearer <key>` (scheme case-insensitive,
/// one or more spaces/tabs, key = the rest with trailing whitespace trimmed) or else
/// `x-api-key: <key>` (trimmed). None if neither is present or the value is empty. Of several
/// `Authorization` headers the first Bearer one counts.
pub fn presented_key(headers: &Headers) -> Option<&[u8]> {
    if let Some(k) = headers
        .all_known(crate::http::Known::AUTHORIZATION)
        .find_map(bearer)
    {
        return Some(k);
    }
    let v = trim(headers.get_known(crate::http::Known::X_API_KEY)?);
    (!v.is_empty()).then_some(v)
}

fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = trim(value);
    if value.len() < 7 || !value[..6].eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    if !matches!(value[6], b' ' | b'\t') {
        return None;
    }
    let key = trim(&value[7..]);
    (!key.is_empty()).then_some(key)
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t' | b'\r' | b'\n', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t' | b'\r' | b'\n'] = s {
        s = rest;
    }
    s
}

/// The outcome of checking a request's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthDecision {
    /// Auth not enforced for this route (empty table: fail-open).
    Open,
    /// A valid key; the owner.
    Allowed(String),
    /// Missing or wrong key → 401.
    Denied,
}

/// `table` = the route's own inline table if it has one, else the key file's table.
pub fn authorize(headers: &Headers, table: &KeyTable) -> AuthDecision {
    if table.is_empty() {
        return AuthDecision::Open;
    }
    match presented_key(headers).and_then(|k| table.owner_of(k)) {
        Some(owner) => AuthDecision::Allowed(owner.to_string()),
        None => AuthDecision::Denied,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{parse_request, HeadParse};
    use std::io::Write;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn headers(lines: &str) -> Headers {
        let raw = format!("GET / HTTP/1.1\r\nHost: t\r\n{lines}\r\n");
        match parse_request(raw.as_bytes()).unwrap() {
            HeadParse::Complete(h, _) => h.headers,
            HeadParse::Partial => unreachable!(),
        }
    }

    fn pairs(t: &KeyTable) -> Vec<(String, String)> {
        t.entries
            .iter()
            .map(|(k, o)| (String::from_utf8(k.to_vec()).unwrap(), o.clone()))
            .collect()
    }

    fn p(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, o)| (k.to_string(), o.to_string()))
            .collect()
    }

    /// A fresh scratch directory under the system temp dir.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "warmroute-auth-{}-{}-{name}",
            std::process::id(),
            std::thread::current()
                .name()
                .unwrap_or("t")
                .replace("::", "_")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(path: &Path, bytes: &[u8]) {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
    }

    #[test]
    fn parse_commas() {
        let t = KeyTable::parse("k1:alice,k2:bob");
        assert_eq!(pairs(&t), p(&[("k1", "alice"), ("k2", "bob")]));
        assert_eq!(t.len(), 2);
        assert!(!t.is_empty());
    }

    #[test]
    fn parse_skips_a_byte_order_mark() {
        // Notepad saves UTF-8 with one: the first key used to carry it and never match.
        let t = KeyTable::parse("\u{feff}k1:alice\nk2:bob\n");
        assert_eq!(pairs(&t), p(&[("k1", "alice"), ("k2", "bob")]));
        // Only at the start: elsewhere it is part of a key.
        let t = KeyTable::parse("k1:alice,\u{feff}k2:bob");
        assert_eq!(pairs(&t), p(&[("k1", "alice"), ("\u{feff}k2", "bob")]));
    }

    #[test]
    fn parse_newlines_and_mixed() {
        let t = KeyTable::parse("k1:alice\nk2:bob\r\nk3:carol,k4:dave\n");
        assert_eq!(
            pairs(&t),
            p(&[
                ("k1", "alice"),
                ("k2", "bob"),
                ("k3", "carol"),
                ("k4", "dave")
            ])
        );
    }

    #[test]
    fn parse_whitespace_trimmed() {
        let t = KeyTable::parse("  k1 :  alice  ,\t k2\t:bob \n   k3:carol   \n");
        assert_eq!(
            pairs(&t),
            p(&[("k1", "alice"), ("k2", "bob"), ("k3", "carol")])
        );
    }

    #[test]
    fn parse_owner_with_colons() {
        let t = KeyTable::parse("sk-1:team:ml:prod");
        assert_eq!(pairs(&t), p(&[("sk-1", "team:ml:prod")]));
    }

    #[test]
    fn parse_missing_owner_is_unnamed() {
        let t = KeyTable::parse("k1,k2:,k3:   ");
        assert_eq!(
            pairs(&t),
            p(&[("k1", "unnamed"), ("k2", "unnamed"), ("k3", "unnamed")])
        );
    }

    #[test]
    fn parse_empty_entries_and_keys_skipped() {
        let t = KeyTable::parse(",, ,k1:a,,:orphan, :x,\n,\n   \n");
        assert_eq!(pairs(&t), p(&[("k1", "a")]));
        assert!(KeyTable::parse("").is_empty());
        assert!(KeyTable::parse(" , ,\n\n").is_empty());
    }

    #[test]
    fn parse_duplicates_last_wins() {
        let t = KeyTable::parse("k1:old,k2:b\nk1:new");
        assert_eq!(pairs(&t), p(&[("k1", "new"), ("k2", "b")]));
    }

    #[test]
    fn parse_comments_ignored() {
        let t = KeyTable::parse("# rotation 2024\nk1:a\n   # k2:b\n#k3:c,k4:d\nk5:e");
        assert_eq!(pairs(&t), p(&[("k1", "a"), ("k5", "e")]));
        assert!(KeyTable::parse("# only a comment\n").is_empty());
    }

    #[test]
    fn from_pairs_same_rules() {
        let t = KeyTable::from_pairs(p(&[("sk-one", "alice"), (" sk-two ", ""), ("", "x")]));
        assert_eq!(pairs(&t), p(&[("sk-one", "alice"), ("sk-two", "unnamed")]));
    }

    #[test]
    fn owners_sorted_dedup() {
        let t = KeyTable::parse("k3:bob,k1:alice,k2:bob,k4");
        assert_eq!(t.owners(), vec!["alice", "bob", "unnamed"]);
    }

    #[test]
    fn fingerprint_tracks_content() {
        let a = KeyTable::parse("k1:a,k2:b");
        let b = KeyTable::parse("k2:b\nk1:a");
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), KeyTable::parse("k1:a").fingerprint());
        assert_ne!(a.fingerprint(), KeyTable::parse("k1:a,k2:c").fingerprint());
        assert_ne!(a.fingerprint(), KeyTable::parse("k1:a,k3:b").fingerprint());
        assert_ne!(
            KeyTable::default().fingerprint(),
            KeyTable::parse("k:o").fingerprint()
        );
    }

    #[test]
    fn debug_never_shows_keys() {
        let t = KeyTable::parse("sk-supersecret-123:alice,sk-other-456:bob");
        let s = format!("{t:?}");
        assert!(
            !s.contains("supersecret") && !s.contains("other-456"),
            "{s}"
        );
        assert!(s.contains("alice") && s.contains('2'), "{s}");
        let f = KeyFile {
            path: None,
            status: KeyFileStatus::Ok,
            table: Arc::new(t),
            kept_previous: false,
            stamp: FileStamp::missing(),
        };
        assert!(!format!("{f:?}").contains("supersecret"));
    }

    #[test]
    fn owner_of_exact_match_only() {
        let t = KeyTable::parse("abc:alice,abcd:bob");
        assert_eq!(t.owner_of(b"abc"), Some("alice"));
        assert_eq!(t.owner_of(b"abcd"), Some("bob"));
        assert_eq!(t.owner_of(b"ab"), None);
        assert_eq!(t.owner_of(b"abcde"), None);
        assert_eq!(t.owner_of(b"abx"), None);
        assert_eq!(t.owner_of(b""), None);
        assert_eq!(t.owner_of(b"ABC"), None);
        assert_eq!(KeyTable::default().owner_of(b"abc"), None);
    }

    #[test]
    fn owner_of_scans_all_keys() {
        let text: Vec<String> = (0..1000).map(|i| format!("key-{i:04}:owner-{i}")).collect();
        let t = KeyTable::parse(&text.join(","));
        assert_eq!(t.len(), 1000);
        assert_eq!(t.owner_of(b"key-0999"), Some("owner-999"));
        assert_eq!(t.owner_of(b"key-0000"), Some("owner-0"));
        assert_eq!(t.owner_of(b"key-0500"), Some("owner-500"));
        assert_eq!(t.owner_of(b"key-1000"), None);
    }

    #[test]
    fn ct_eq_cases() {
        assert_eq!(ct_eq(b"a", b"a"), 1);
        assert_eq!(ct_eq(b"a", b"b"), 0);
        assert_eq!(ct_eq(b"a", b""), 0);
        assert_eq!(ct_eq(b"ab", b"a"), 0);
        assert_eq!(ct_eq(b"a", b"a\0"), 0);
        assert_eq!(ct_eq(b"\xff\x80", b"\xff\x80"), 1);
    }

    #[test]
    fn status_strings() {
        for (s, name) in [
            (KeyFileStatus::Ok, "ok"),
            (KeyFileStatus::Missing, "missing"),
            (KeyFileStatus::Unreadable, "unreadable"),
            (KeyFileStatus::Empty, "empty"),
            (KeyFileStatus::Unset, "unset"),
        ] {
            assert_eq!(s.as_str(), name);
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{name}\""));
        }
    }

    #[test]
    fn load_ok() {
        let dir = scratch("load_ok");
        let path = dir.join("keys");
        write(&path, b"k1:alice,k2:bob\n");
        let kf = load_key_file(Some(&path));
        assert_eq!(kf.status, KeyFileStatus::Ok);
        assert_eq!(kf.path.as_deref(), Some(path.as_path()));
        assert_eq!(kf.table.owner_of(b"k2"), Some("bob"));
        assert!(kf.stamp.exists());
        assert_eq!(kf.stamp, file_stamp(&path));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_unset() {
        let kf = load_key_file(None);
        assert_eq!(kf.status, KeyFileStatus::Unset);
        assert!(kf.table.is_empty());
        assert!(kf.path.is_none());
    }

    #[test]
    fn load_missing() {
        let dir = scratch("load_missing");
        let path = dir.join("nope");
        let kf = load_key_file(Some(&path));
        assert_eq!(kf.status, KeyFileStatus::Missing);
        assert!(kf.table.is_empty());
        assert!(!kf.stamp.exists());
        assert_eq!(kf.stamp, file_stamp(&dir.join("also-nope")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_unreadable() {
        let dir = scratch("load_unreadable");
        // A directory.
        let kf = load_key_file(Some(&dir));
        assert_eq!(kf.status, KeyFileStatus::Unreadable);
        assert!(kf.table.is_empty());
        // Invalid UTF-8.
        let bad = dir.join("bad");
        write(&bad, b"k1:al\xffice");
        assert_eq!(load_key_file(Some(&bad)).status, KeyFileStatus::Unreadable);
        // Mode 000: only meaningful when not running as root (root reads it anyway).
        let locked = dir.join("locked");
        write(&locked, b"k1:alice");
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
        if std::fs::read(&locked).is_err() {
            assert_eq!(
                load_key_file(Some(&locked)).status,
                KeyFileStatus::Unreadable
            );
        }
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_empty() {
        let dir = scratch("load_empty");
        for (i, text) in ["", "\n\n", " , ,", "# just a comment\n", ":owner"]
            .iter()
            .enumerate()
        {
            let path = dir.join(format!("keys{i}"));
            write(&path, text.as_bytes());
            let kf = load_key_file(Some(&path));
            assert_eq!(kf.status, KeyFileStatus::Empty, "{text:?}");
            assert!(kf.table.is_empty());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stamp_stable_and_tracks_content() {
        let dir = scratch("stamp_content");
        let path = dir.join("keys");
        write(&path, b"k1:a");
        let s1 = file_stamp(&path);
        assert_eq!(s1, file_stamp(&path));
        // Same size, rewritten in place: the mtime moves (ensure it does on coarse clocks).
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(&path, b"k2:b");
        let s2 = file_stamp(&path);
        assert_ne!(s1, s2);
        assert_eq!(s2, file_stamp(&path));
        // Different size.
        write(&path, b"k2:b,k3:c");
        assert_ne!(s2, file_stamp(&path));
        // Removed.
        std::fs::remove_file(&path).unwrap();
        assert!(!file_stamp(&path).exists());
        assert_ne!(s2, file_stamp(&path));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stamp_follows_k8s_symlink_swap() {
        // dir/v1/keys, dir/..data -> v1, dir/keys -> ..data/keys
        let dir = scratch("stamp_k8s");
        std::fs::create_dir(dir.join("v1")).unwrap();
        write(&dir.join("v1/keys"), b"k1:a");
        symlink("v1", dir.join("..data")).unwrap();
        symlink("..data/keys", dir.join("keys")).unwrap();
        let path = dir.join("keys");

        let s1 = file_stamp(&path);
        assert!(s1.exists());
        assert_eq!(s1, file_stamp(&path));
        assert_eq!(load_key_file(Some(&path)).table.owner_of(b"k1"), Some("a"));

        // The kubelet writes v2, points a temporary link at it and renames it over ..data.
        std::fs::create_dir(dir.join("v2")).unwrap();
        write(&dir.join("v2/keys"), b"k1:a");
        symlink("v2", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        std::fs::remove_dir_all(dir.join("v1")).unwrap();

        let s2 = file_stamp(&path);
        assert!(s2.exists());
        assert_ne!(s1, s2, "same bytes, but a different file behind the link");
        assert_eq!(s2, file_stamp(&path));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn presented_bearer() {
        for line in [
            "Authorization: Bearer sk-1",
            "authorization: bearer sk-1",
            "AUTHORIZATION: BEARER sk-1",
            "Authorization: bEaReR sk-1",
            "Authorization: Bearer    sk-1   ",
            "Authorization: Bearer \t sk-1\t",
        ] {
            let h = headers(&format!("{line}\r\n"));
            assert_eq!(presented_key(&h), Some(&b"sk-1"[..]), "{line}");
        }
    }

    #[test]
    fn presented_not_bearer() {
        for line in [
            "Authorization: Bearer",
            "Authorization: Bearer   ",
            "Authorization: Bearersk-1",
            "Authorization: Basic c2stMQ==",
            "Authorization: sk-1",
            "Authorization:",
        ] {
            let h = headers(&format!("{line}\r\n"));
            assert_eq!(presented_key(&h), None, "{line}");
        }
    }

    #[test]
    fn presented_x_api_key() {
        let h = headers("x-api-key: sk-2\r\n");
        assert_eq!(presented_key(&h), Some(&b"sk-2"[..]));
        let h = headers("X-Api-Key:    sk-2   \r\n");
        assert_eq!(presented_key(&h), Some(&b"sk-2"[..]));
        assert_eq!(presented_key(&headers("x-api-key: \r\n")), None);
        // A non-Bearer Authorization does not hide x-api-key.
        let h = headers("Authorization: Basic abc\r\nx-api-key: sk-2\r\n");
        assert_eq!(presented_key(&h), Some(&b"sk-2"[..]));
    }

    #[test]
    fn presented_authorization_wins() {
        let h = headers("x-api-key: sk-2\r\nAuthorization: Bearer sk-1\r\n");
        assert_eq!(presented_key(&h), Some(&b"sk-1"[..]));
        let h = headers("Authorization: Bearer sk-1\r\nx-api-key: sk-2\r\n");
        assert_eq!(presented_key(&h), Some(&b"sk-1"[..]));
    }

    #[test]
    fn presented_none() {
        assert_eq!(presented_key(&headers("")), None);
        assert_eq!(presented_key(&headers("X-Other: x\r\n")), None);
    }

    #[test]
    fn authorize_decisions() {
        let t = KeyTable::parse("sk-1:alice,sk-2:bob");
        assert_eq!(
            authorize(&headers("Authorization: Bearer sk-1\r\n"), &t),
            AuthDecision::Allowed("alice".into())
        );
        assert_eq!(
            authorize(&headers("x-api-key: sk-2\r\n"), &t),
            AuthDecision::Allowed("bob".into())
        );
        assert_eq!(
            authorize(&headers("Authorization: Bearer sk-3\r\n"), &t),
            AuthDecision::Denied
        );
        assert_eq!(authorize(&headers(""), &t), AuthDecision::Denied);
        // Authorization wins even when its key is wrong and x-api-key's is right.
        assert_eq!(
            authorize(
                &headers("Authorization: Bearer wrong\r\nx-api-key: sk-1\r\n"),
                &t
            ),
            AuthDecision::Denied
        );
        // Empty table: fail-open, whatever the request carries.
        let empty = KeyTable::default();
        assert_eq!(authorize(&headers(""), &empty), AuthDecision::Open);
        assert_eq!(
            authorize(&headers("Authorization: Bearer sk-1\r\n"), &empty),
            AuthDecision::Open
        );
    }
}
