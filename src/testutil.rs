//! Helpers shared by the unit tests: a seeded PRNG, so randomized tests replay exactly,
//! and a small shared segment in a temporary file.

/// xorshift64* with a fixed seed: deterministic across runs and machines.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in 0..n (0 when n is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `seed` with one to four random edits: truncate, overwrite a byte, splice one of
/// `specials` (the byte runs that matter to the grammar under test), cut up to 15 bytes,
/// or repeat a run of up to 31.
pub fn mutate(rng: &mut XorShift, seed: &[u8], specials: &[&[u8]]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let pos = rng.below(b.len() + 1);
        match rng.below(5) {
            0 => b.truncate(pos),
            1 => {
                if pos < b.len() {
                    b[pos] = rng.next() as u8;
                }
            }
            2 => {
                let s = specials[rng.below(specials.len())];
                b.splice(pos..pos, s.iter().copied());
            }
            3 => {
                let end = (pos + rng.below(16)).min(b.len());
                b.drain(pos..end);
            }
            _ => {
                let end = (pos + rng.below(32)).min(b.len());
                let run = b[pos..end].to_vec();
                b.splice(pos..pos, run);
            }
        }
    }
    b
}

/// A small segment (1 worker row, 1 peer slot, 16 route slots; or more worker rows with
/// [`TempSegment::with_workers`]) in a file of its own under the temp directory, removed on
/// drop.
pub struct TempSegment {
    pub seg: std::sync::Arc<warmroute_shm::Segment>,
    path: std::path::PathBuf,
}

impl TempSegment {
    /// `tag` tells apart the tests of one process.
    pub fn new(tag: &str) -> TempSegment {
        TempSegment::with_workers(tag, 1)
    }

    /// The same segment with `workers` worker rows.
    pub fn with_workers(tag: &str, workers: u32) -> TempSegment {
        let path =
            std::env::temp_dir().join(format!("warmroute-unit-{tag}-{}", std::process::id()));
        let seg = warmroute_shm::Segment::open_or_create(
            &path,
            warmroute_shm::Capacities {
                workers,
                peers: 1,
                routes: 16,
            },
        )
        .unwrap();
        TempSegment {
            seg: std::sync::Arc::new(seg),
            path,
        }
    }
}

impl Drop for TempSegment {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
