//! How a write batch is cut into one contiguous share per UCX lane.

use crate::Bytes;

/// A lane gets at least this much of a batch: below it, waking another thread costs more
/// than the copy it would take over.
const MIN_LANE_SHARE: u64 = 1 << 20;

/// Pieces of a put shorter than this are not split off: the lane takes the whole rest.
const MIN_PIECE: u64 = 64 << 10;

/// Cuts a batch (source bytes, remote address) into one contiguous share per lane, in batch
/// order, each about `total / n` bytes (n = the lanes the batch is worth, at most `lanes`);
/// large puts are split into zero-copy `Bytes` slices at 4 KiB-aligned cuts.
pub(super) fn stripe(puts: Vec<(Bytes, u64)>, total: u64, lanes: usize) -> Vec<Vec<(Bytes, u64)>> {
    let n = (total / MIN_LANE_SHARE).clamp(1, lanes.max(1) as u64) as usize;
    if n == 1 {
        return vec![puts];
    }
    let share = total.div_ceil(n as u64).next_multiple_of(4096);
    let mut out: Vec<Vec<(Bytes, u64)>> = (0..n).map(|_| Vec::new()).collect();
    let (mut lane, mut fill) = (0usize, 0u64);
    for (buf, addr) in puts {
        let len = buf.len() as u64;
        let mut off = 0u64;
        while off < len {
            if fill >= share && lane + 1 < n {
                lane += 1;
                fill = 0;
            }
            let rest = len - off;
            let mut take = if lane + 1 == n {
                rest
            } else {
                rest.min(share - fill)
            };
            if rest - take < MIN_PIECE {
                take = rest;
            }
            let piece = if off == 0 && take == len {
                buf.clone()
            } else {
                buf.slice(off as usize..(off + take) as usize)
            };
            out[lane].push((piece, addr + off));
            off += take;
            fill += take;
        }
    }
    out.retain(|l| !l.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(sizes: &[usize]) -> (Vec<(Bytes, u64)>, u64) {
        let mut addr = 0x10_0000u64;
        let mut total = 0;
        let puts = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let p = (Bytes::from(vec![i as u8; n]), addr);
                // Scattered destinations: a gap after every put.
                addr += n as u64 + 8192;
                total += n as u64;
                p
            })
            .collect();
        (puts, total)
    }

    #[test]
    fn stripe_covers_every_byte_once_in_order_and_balances_lanes() {
        let block = 3_670_016;
        for (sizes, lanes, want) in [
            (vec![block; 64], 4, 4),
            (vec![block; 3], 4, 4),
            (vec![block], 4, 3),
            (vec![131_072; 64], 4, 4),
            (vec![131_072; 4], 4, 1),
            (vec![(1 << 20) + 4100; 5], 4, 4),
            (vec![7, 0, 1 << 22, 5000, 3 << 20], 3, 3),
            (vec![block; 8], 1, 1),
        ] {
            let (puts, total) = batch(&sizes);
            let shares = stripe(puts.clone(), total, lanes);
            assert_eq!(shares.len(), want, "{sizes:?} over {lanes}");
            // Concatenating the shares gives back the batch, byte for byte and in order.
            let flat: Vec<(Bytes, u64)> = shares.iter().flatten().cloned().collect();
            let (mut i, mut off) = (0usize, 0u64);
            for (piece, addr) in &flat {
                while puts[i].0.len() as u64 == off {
                    i += 1;
                    off = 0;
                }
                assert_eq!(*addr, puts[i].1 + off);
                let src = &puts[i].0[off as usize..off as usize + piece.len()];
                assert_eq!(&piece[..], src);
                off += piece.len() as u64;
            }
            let moved: u64 = flat.iter().map(|(b, _)| b.len() as u64).sum();
            assert_eq!(moved, total);
            if want > 1 {
                let share = total.div_ceil(want as u64).next_multiple_of(4096);
                for s in &shares {
                    let n: u64 = s.iter().map(|(b, _)| b.len() as u64).sum();
                    assert!(n > 0 && n < share + MIN_PIECE, "{n} vs {share}");
                }
            }
        }
    }
}
