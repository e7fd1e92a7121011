//! A step's integer inputs on the device — token ids, the rows whose logits are wanted, and
//! the token maps the attention and KV-write kernels index by — packed into one buffer that
//! one host→device copy fills per step (eight small copies, each a driver round trip with the
//! GPU idle in between, cost more than a decode step's host work otherwise does).

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};

use super::attention::FA_KEYS;
use super::prefill_schedule::{schedule, Job, PieceSchedule};
use super::{bad, cuda_err, to_i32, CudaDevice};
use crate::error::EngineError;

/// A device address handed to kernels as a plain pointer argument (`const int*`). It stays
/// valid while the buffer it points into lives: [`TokenMaps`] bumps its `generation` when it
/// reallocates, and captured graphs are dropped then.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevAddr(u64);

// SAFETY: a CUdeviceptr, passed by value like the pointer parameter it stands for.
unsafe impl DeviceRepr for DevAddr {}

impl DevAddr {
    /// The address as the driver takes it (raw kernel parameters).
    pub(super) fn raw(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on.
    pub fn offset_bytes(self, bytes: usize) -> DevAddr {
        DevAddr(self.0 + bytes as u64)
    }
}

/// A list of 32-bit integers on the device: its address and how many values it holds.
#[derive(Clone, Copy, Debug)]
pub struct DeviceList {
    pub addr: DevAddr,
    pub len: usize,
}

impl CudaDevice {
    /// `s` as a [`DeviceList`]; `s` must outlive every launch that reads the list.
    pub fn list_of<T>(&self, s: &CudaSlice<T>) -> DeviceList {
        // Event tracking is off (CudaDevice::new), so the guard has nothing to record.
        let (ptr, _guard) = s.device_ptr(&self.stream);
        DeviceList {
            addr: DevAddr(ptr),
            len: s.len(),
        }
    }
}

/// The per-token inputs of a step on the device: the flattened block tables of the batch
/// and, per token, where its table starts, its position, its first visible position (sliding
/// window) and its block; with them the step's token ids and logits rows. One buffer, laid out
/// afresh each step (ids, rows, table starts, positions, window starts, blocks, single rows:
/// `tokens` each; then the tiles, then the tables), so a step of the same shape — a decode
/// step of the same batch size, which is what graphs are keyed by — has the same addresses.
pub struct TokenMaps {
    buf: CudaSlice<i32>,
    /// The host image of `buf`, kept to avoid an allocation per step.
    host: Vec<i32>,
    pub ids: DevAddr,
    pub rows: DevAddr,
    pub n_rows: usize,
    pub tables: DevAddr,
    pub table_start: DevAddr,
    pub positions: DevAddr,
    pub lo_pos: DevAddr,
    pub token_block: DevAddr,
    pub tokens: usize,
    /// Tokens per tile of the tensor-core prefill attention (0: no tiles, every token goes to
    /// `attention_fast`). Set by the owner; [`CudaDevice::fill_token_maps`] then splits the
    /// step: sequences with several tokens into `tiles`, the others into `singles`.
    pub tile_tokens: usize,
    /// With tiles on: the single-token rows (decode) go to the tensor-core decode kernel
    /// when a step has at least this many of them (it reads K/V in wide runs, faster once
    /// the rows fill the GPU), else to `attention_fast`. Set by the owner.
    pub decode_tc_min: usize,
    /// Where the prefill attention's blocks go on the GPU (none: the tiles go longest first
    /// alone): with every block of a launch resident at once, the tiles that take the SMs'
    /// first slots go longest first and the rest, which share those SMs, shortest first, so
    /// that each SM's tiles add up to about the same number of key runs. Set by the owner.
    pub tile_slots: Option<TileSlots>,
    /// How the warpgroup prefill attention's blocks take the tiles (none: the tiles as
    /// (first token, tokens) pairs, one block per tile and KV head, for the other tile
    /// kernels). Set by the owner.
    pub pieces: Option<PieceSchedule>,
    /// (first token, tokens) per tile, each within one sequence, in launch order (see
    /// `tile_slots`); with `pieces`, the schedule of `prefill_schedule.rs` instead.
    pub tiles: DevAddr,
    pub n_tiles: usize,
    /// With `pieces`: the blocks of the launch and the partial-state slots its cut tiles use.
    pub piece_blocks: usize,
    pub state_slots: usize,
    /// The tokens of single-token sequences (decode rows) when tiles are on.
    pub singles: DevAddr,
    pub n_singles: usize,
    /// Whether this step's singles go to the tensor-core decode kernel (see `decode_tc_min`).
    pub decode_tc: bool,
    /// Bumped whenever the buffer is reallocated (graphs captured before hold stale addresses).
    pub generation: u64,
}

impl TokenMaps {
    /// Maps with room for a few tokens (grown by [`CudaDevice::fill_token_maps`]).
    pub fn empty(dev: &CudaDevice) -> Result<Self, EngineError> {
        let buf: CudaSlice<i32> = dev.zeros(64)?;
        let base = dev.list_of(&buf).addr;
        Ok(TokenMaps {
            buf,
            host: Vec::new(),
            ids: base,
            rows: base,
            n_rows: 0,
            tables: base,
            table_start: base,
            positions: base,
            lo_pos: base,
            token_block: base,
            tokens: 0,
            tile_tokens: 0,
            decode_tc_min: usize::MAX,
            tile_slots: None,
            pieces: None,
            tiles: base,
            n_tiles: 0,
            piece_blocks: 0,
            state_slots: 0,
            singles: base,
            n_singles: 0,
            decode_tc: false,
            generation: 0,
        })
    }

    /// The step's token ids (one per token).
    pub fn id_list(&self) -> DeviceList {
        DeviceList {
            addr: self.ids,
            len: self.tokens,
        }
    }

    /// The step's logits rows (token indices).
    pub fn row_list(&self) -> DeviceList {
        DeviceList {
            addr: self.rows,
            len: self.n_rows,
        }
    }
}

impl CudaDevice {
    /// Builds the [`TokenMaps`] of a step on the device (fresh buffers). `seqs` gives, per
    /// sequence, its block table and the positions of its tokens this step; `window` is the
    /// sliding window (`usize::MAX` for none).
    pub fn token_maps(
        &self,
        seqs: &[(&[u32], std::ops::Range<usize>)],
        block_size: usize,
        window: usize,
    ) -> Result<TokenMaps, EngineError> {
        let mut maps = TokenMaps::empty(self)?;
        self.fill_token_maps(&mut maps, seqs, block_size, window)?;
        Ok(maps)
    }

    /// Writes a step's maps into `maps` (no ids, no logits rows).
    pub fn fill_token_maps(
        &self,
        maps: &mut TokenMaps,
        seqs: &[(&[u32], std::ops::Range<usize>)],
        block_size: usize,
        window: usize,
    ) -> Result<(), EngineError> {
        self.fill_step_maps(maps, &[], &[], seqs, block_size, window)
    }

    /// Writes a step's token ids (empty, or one per token), logits rows (token indices) and
    /// maps into `maps`' buffer with one copy, growing it (by doubling, which bumps
    /// `maps.generation`) only when too small.
    pub fn fill_step_maps(
        &self,
        maps: &mut TokenMaps,
        ids: &[u32],
        rows: &[u32],
        seqs: &[(&[u32], std::ops::Range<usize>)],
        block_size: usize,
        window: usize,
    ) -> Result<(), EngineError> {
        let tiling = Tiling {
            tokens: maps.tile_tokens,
            slots: maps.tile_slots,
            pieces: maps.pieces,
            window,
        };
        let l = write_image(&mut maps.host, ids, rows, seqs, block_size, tiling)?;
        if l.total > maps.buf.len() {
            maps.buf = self.zeros(l.total.next_power_of_two())?;
            maps.generation += 1;
        }
        if l.total > 0 {
            self.stream
                .memcpy_htod(&maps.host[..], &mut maps.buf.slice_mut(..l.total))
                .map_err(cuda_err("host→device copy of the step inputs"))?;
        }
        let base = self.list_of(&maps.buf).addr;
        let at = |i: usize| base.offset_bytes(i * std::mem::size_of::<i32>());
        let t = l.tokens;
        maps.ids = at(0);
        maps.rows = at(t);
        maps.n_rows = rows.len();
        maps.table_start = at(2 * t);
        maps.positions = at(3 * t);
        maps.lo_pos = at(4 * t);
        maps.token_block = at(5 * t);
        maps.singles = at(6 * t);
        maps.tiles = at(l.tiles_at);
        maps.tables = at(l.tables_at);
        maps.tokens = t;
        maps.n_tiles = l.n_tiles;
        maps.piece_blocks = l.piece_blocks;
        maps.state_slots = l.state_slots;
        maps.n_singles = l.n_singles;
        maps.decode_tc = l.n_singles >= maps.decode_tc_min;
        Ok(())
    }
}

/// Where [`write_image`] put things (offsets in i32 elements).
#[derive(Debug, PartialEq, Eq)]
struct ImageLayout {
    tokens: usize,
    tiles_at: usize,
    n_tiles: usize,
    piece_blocks: usize,
    state_slots: usize,
    n_singles: usize,
    tables_at: usize,
    total: usize,
}

/// Where the blocks of the prefill attention go: `per_sm` resident on each SM, and `sms`
/// tiles (each one block per KV head) fill one slot of every SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileSlots {
    pub per_sm: usize,
    pub sms: usize,
}

/// How a step's multi-token sequences are cut into prefill attention tiles: `tokens` per tile
/// (0: no tiles), ordered for `slots` (see [`TokenMaps::tile_slots`]) and laid out as pairs
/// or as `pieces` (see [`TokenMaps::pieces`]), each token seeing the `window` positions up to
/// its own.
#[derive(Clone, Copy, Debug)]
struct Tiling {
    tokens: usize,
    slots: Option<TileSlots>,
    pieces: Option<PieceSchedule>,
    window: usize,
}

/// Writes the host image of a step's [`TokenMaps`] buffer into `host`: ids, rows, table
/// starts, positions, window starts, blocks and single rows (`tokens` slots each), then the
/// tiles ((first token, tokens) pairs in launch order, or their piece schedule, with
/// `tiling.tokens > 0`), then the block tables.
fn write_image(
    host: &mut Vec<i32>,
    ids: &[u32],
    rows: &[u32],
    seqs: &[(&[u32], std::ops::Range<usize>)],
    block_size: usize,
    tiling: Tiling,
) -> Result<ImageLayout, EngineError> {
    let window = tiling.window;
    let t: usize = seqs.iter().map(|(_, r)| r.len()).sum();
    check_image_inputs(ids, rows, t, block_size)?;
    let (tiles, singles) = tiles_and_singles(seqs, tiling)?;
    let n_tiles = tiles.len();
    let (tiles, piece_blocks, state_slots) = tile_ints(&tiles, tiling.pieces)?;
    let n_tables: usize = seqs.iter().map(|(table, _)| table.len()).sum();
    let (tiles_at, tables_at) = (7 * t, 7 * t + tiles.len());
    let total = tables_at + n_tables;
    host.clear();
    host.resize(total, 0);
    for (slot, &id) in host.iter_mut().zip(ids) {
        *slot = id as i32; // below the vocabulary size (checked by the caller)
    }
    for (slot, &r) in host[t..].iter_mut().zip(rows) {
        *slot = r as i32; // below t (checked above)
    }
    let (mut tok, mut table_at) = (0, 0);
    for (table, range) in seqs {
        let start = to_i32("block table offset", table_at)?;
        for (k, &b) in table.iter().enumerate() {
            host[tables_at + table_at + k] = to_i32("block id", b as usize)?;
        }
        table_at += table.len();
        for pos in range.clone() {
            let block = *table.get(pos / block_size).ok_or_else(|| {
                bad(format!(
                    "block table of {} blocks does not cover position {pos}",
                    table.len()
                ))
            })?;
            host[2 * t + tok] = start;
            host[3 * t + tok] = to_i32("position", pos)?;
            host[4 * t + tok] = to_i32("position", (pos + 1).saturating_sub(window))?;
            host[5 * t + tok] = to_i32("block id", block as usize)?;
            tok += 1;
        }
    }
    host[6 * t..6 * t + singles.len()].copy_from_slice(&singles);
    host[tiles_at..tables_at].copy_from_slice(&tiles);
    Ok(ImageLayout {
        tokens: t,
        tiles_at,
        n_tiles,
        piece_blocks,
        state_slots,
        n_singles: singles.len(),
        tables_at,
        total,
    })
}

/// The step's ids (none, or one per token) and logits rows (at most one per token, each a
/// token of the step) fit its `t` tokens, and the block size is not 0.
fn check_image_inputs(
    ids: &[u32],
    rows: &[u32],
    t: usize,
    block_size: usize,
) -> Result<(), EngineError> {
    if !ids.is_empty() && ids.len() != t {
        return Err(bad(format!("{} token ids for {t} tokens", ids.len())));
    }
    if rows.len() > t {
        return Err(bad(format!("{} logits rows for {t} tokens", rows.len())));
    }
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= t) {
        return Err(bad(format!("logits row {r} of a step of {t} tokens")));
    }
    if block_size == 0 {
        return Err(bad("block size 0".into()));
    }
    Ok(())
}

/// A tile before ordering: its first token and tokens in the step, and the runs of
/// [`FA_KEYS`] keys its block walks (from the first token's window start to the last
/// token's position).
struct Tile {
    tok0: usize,
    ntok: usize,
    runs: usize,
}

/// With tiles of `tiling.tokens` (0: none), the tiles that cover each sequence of several
/// tokens, in launch order ([`order_tiles`]; longest first alone for a balanced piece
/// schedule, which does its own placing), and the tokens of the single-token sequences
/// (decode rows).
fn tiles_and_singles(
    seqs: &[(&[u32], std::ops::Range<usize>)],
    tiling: Tiling,
) -> Result<(Vec<Tile>, Vec<i32>), EngineError> {
    let mut tiles = Vec::new();
    let mut singles = Vec::new();
    let mut first = 0;
    for (_, range) in seqs {
        if tiling.tokens > 0 && range.len() > 1 {
            let mut at = 0;
            while at < range.len() {
                let n = tiling.tokens.min(range.len() - at);
                let (p0, p1) = (range.start + at, range.start + at + n - 1);
                let keys = (p0 + 1).saturating_sub(tiling.window)..p1 + 1;
                tiles.push(Tile {
                    tok0: first + at,
                    ntok: n,
                    runs: keys.len().div_ceil(FA_KEYS),
                });
                at += n;
            }
        } else if tiling.tokens > 0 && range.len() == 1 {
            singles.push(to_i32("token", first)?);
        }
        first += range.len();
    }
    let balanced = tiling.pieces.is_some_and(|p| p.balance.is_some());
    order_tiles(&mut tiles, if balanced { None } else { tiling.slots });
    Ok((tiles, singles))
}

/// The tile area's ints: (first token, tokens) per tile, or with `pieces` the schedule of
/// one job per tile and KV head; with the schedule's blocks and state slots.
fn tile_ints(
    tiles: &[Tile],
    pieces: Option<PieceSchedule>,
) -> Result<(Vec<i32>, usize, usize), EngineError> {
    let Some(how) = pieces else {
        let mut pairs = Vec::with_capacity(2 * tiles.len());
        for t in tiles {
            pairs.push(to_i32("token", t.tok0)?);
            pairs.push(to_i32("tile tokens", t.ntok)?);
        }
        return Ok((pairs, 0, 0));
    };
    let mut jobs = Vec::with_capacity(tiles.len() * how.heads);
    for t in tiles {
        for head in 0..how.heads {
            jobs.push(Job {
                tok0: t.tok0,
                ntok: t.ntok,
                head,
                runs: t.runs,
            });
        }
    }
    let s = schedule(&jobs, how)?;
    Ok((s.ints, s.blocks, s.state_slots))
}

/// The launch order of `tiles`: longest first (the blocks the GPU starts last are short
/// ones); and where every block is resident at once on `slots` with SMs shared, the tiles
/// past the SMs' first slots reversed (shortest first), so that the GPU, which hands out
/// blocks one per SM before the second, pairs each SM's longest tile with a short one. A
/// causal prefill's tiles grow by a run each: unpaired, the SMs holding the longest tiles
/// hold the next longest too and set the launch's length.
fn order_tiles(tiles: &mut [Tile], slots: Option<TileSlots>) {
    tiles.sort_by_key(|t| std::cmp::Reverse(t.runs));
    if let Some(TileSlots { per_sm, sms }) = slots {
        if per_sm >= 2 && sms < tiles.len() && tiles.len() <= per_sm * sms {
            tiles[sms..].reverse();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiling(tokens: usize, window: usize) -> Tiling {
        Tiling {
            tokens,
            slots: None,
            pieces: None,
            window,
        }
    }

    #[test]
    fn image_holds_every_list_at_its_offset() {
        // A prefill of 3 tokens (positions 4..7 of a 2-block table) and a decode row.
        let (t_a, t_b) = ([7u32, 9], [5u32]);
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = vec![(&t_a, 4..7), (&t_b, 2..3)];
        let mut host = vec![99; 3];
        let l = write_image(&mut host, &[1, 2, 3, 4], &[2, 3], &seqs, 4, tiling(2, 2)).unwrap();
        assert_eq!(
            l,
            ImageLayout {
                tokens: 4,
                tiles_at: 28,
                n_tiles: 2,
                piece_blocks: 0,
                state_slots: 0,
                n_singles: 1,
                tables_at: 32,
                total: 35
            }
        );
        let t = 4;
        assert_eq!(&host[..t], &[1, 2, 3, 4]);
        assert_eq!(&host[t..2 * t], &[2, 3, 0, 0]);
        assert_eq!(&host[2 * t..3 * t], &[0, 0, 0, 2], "table starts");
        assert_eq!(&host[3 * t..4 * t], &[4, 5, 6, 2], "positions");
        assert_eq!(&host[4 * t..5 * t], &[3, 4, 5, 1], "window starts");
        assert_eq!(&host[5 * t..6 * t], &[9, 9, 9, 5], "blocks");
        assert_eq!(&host[6 * t..7 * t], &[3, 0, 0, 0], "single rows");
        assert_eq!(&host[28..32], &[0, 2, 2, 1], "tiles");
        assert_eq!(&host[32..], &[7, 9, 5], "tables");
    }

    #[test]
    fn decode_steps_of_one_batch_size_share_offsets() {
        // Graphs are keyed by batch size: longer tables must not move the other lists.
        let short = [1u32];
        let long = [1u32, 2, 3];
        let mut host = Vec::new();
        let a = write_image(
            &mut host,
            &[5],
            &[0],
            &[(&short, 3..4)],
            16,
            tiling(64, usize::MAX),
        )
        .unwrap();
        let b = write_image(
            &mut host,
            &[5],
            &[0],
            &[(&long, 40..41)],
            16,
            tiling(64, usize::MAX),
        )
        .unwrap();
        assert_eq!((a.tiles_at, a.tables_at), (b.tiles_at, b.tables_at));
        assert_eq!(b.total, a.total + 2);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let table = [0u32];
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = vec![(&table, 0..2)];
        let mut host = Vec::new();
        let e = |r: Result<ImageLayout, EngineError>| r.unwrap_err().to_string();
        assert!(e(write_image(&mut host, &[1], &[], &seqs, 4, tiling(0, 8)))
            .contains("1 token ids for 2"));
        assert!(
            e(write_image(&mut host, &[], &[2], &seqs, 4, tiling(0, 8))).contains("logits row 2")
        );
        assert!(e(write_image(
            &mut host,
            &[],
            &[0, 1, 1],
            &seqs,
            4,
            tiling(0, 8)
        ))
        .contains("3 logits rows"));
        let far: Vec<(&[u32], std::ops::Range<usize>)> = vec![(&table, 3..5)];
        assert!(e(write_image(&mut host, &[], &[], &far, 4, tiling(0, 8)))
            .contains("does not cover position 4"));
    }

    /// The tiles (first token, tokens) of a causal prefill of `n` tokens from position 0
    /// and of a 16-token decode-free chunk at position 5,000, in tiles of 64, on `slots`.
    fn launch_order(n: usize, slots: Option<TileSlots>) -> Vec<(i32, i32)> {
        let table = vec![0u32; 5016usize.div_ceil(16)];
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> =
            vec![(&table, 0..n), (&table, 5000..5016)];
        let t = Tiling {
            tokens: 64,
            slots,
            pieces: None,
            window: usize::MAX,
        };
        let (tiles, _) = tiles_and_singles(&seqs, t).unwrap();
        tiles
            .iter()
            .map(|t| (t.tok0 as i32, t.ntok as i32))
            .collect()
    }

    #[test]
    fn tiles_go_longest_first() {
        // The chunk over 5,000 cached positions (79 runs) first, then the prefill's last
        // tile (the partial one of 20 tokens, 7 runs) down to its first.
        let order = launch_order(404, None);
        let firsts: Vec<i32> = order.iter().map(|t| t.0).collect();
        assert_eq!(firsts, [404, 384, 320, 256, 192, 128, 64, 0]);
        assert_eq!((order[0].1, order[1].1), (16, 20));
    }

    #[test]
    fn tiles_sharing_sms_pair_long_with_short() {
        // 2,048 tokens (32 tiles of 1 ..= 32 runs; with the chunk's, 33 tiles) on 17 SMs'
        // worth of tiles, two per SM: the first 17 longest first, the other 16 shortest
        // first, so that each SM's two tiles take 34 runs (the chunk's SM: 79 and 1).
        let slots = Some(TileSlots { per_sm: 2, sms: 17 });
        let order = launch_order(2048, slots);
        let runs = |tok0: i32| if tok0 == 2048 { 79 } else { tok0 / 64 + 1 };
        let r: Vec<i32> = order.iter().map(|t| runs(t.0)).collect();
        assert_eq!((&r[..3], r[16]), (&[79, 32, 31][..], 17));
        assert_eq!((&r[17..20], r[32]), (&[1, 2, 3][..], 16));
        // More tiles than the GPU holds at once (a second wave), or one per SM: longest
        // first alone.
        for slots in [
            TileSlots { per_sm: 2, sms: 8 },
            TileSlots { per_sm: 1, sms: 40 },
        ] {
            let order = launch_order(2048, Some(slots));
            assert_eq!(order, launch_order(2048, None));
        }
    }

    #[test]
    fn a_piece_schedule_takes_the_tile_area() {
        // A prefill of 130 tokens (tiles of 64: 1, 2 and 3 runs) over 2 KV heads, a run per
        // block: the schedule's offsets and pieces where the pairs were, the tables after.
        let table = [0u32; 9];
        let seqs: Vec<(&[u32], std::ops::Range<usize>)> = vec![(&table, 0..130)];
        let mut t = tiling(64, usize::MAX);
        t.pieces = Some(PieceSchedule {
            heads: 2,
            balance: Some(super::super::prefill_schedule::Balance {
                blocks: 100,
                min_runs: 1,
                piece_runs: 0,
            }),
        });
        let mut host = Vec::new();
        let l = write_image(&mut host, &[], &[], &seqs, 16, t).unwrap();
        assert_eq!((l.n_tiles, l.piece_blocks, l.state_slots), (3, 12, 10));
        let pieces = l.tables_at - l.tiles_at - (l.piece_blocks + 1);
        assert_eq!(pieces, 12 * super::super::prefill_schedule::PIECE_INTS);
        // The first piece: the last tile (tokens 128..130, 3 runs) for head 0, run 0.
        let p = &host[l.tiles_at + l.piece_blocks + 1..][..8];
        assert_eq!(p, &[128, 2, 0, 0, 1, 0, 0, 3]);
        assert_eq!(host.len() - l.tables_at, 9);
    }
}
