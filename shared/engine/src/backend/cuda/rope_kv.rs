//! Launch wrappers of the q/k norms + RoPE (`qk_norm_rope.cu`, with the KV write in the same
//! launch) and of the plain KV write (`kv_write.cu`), over the heads [`HeadNorms`] describes.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::ops::HeadNorms;
use super::{
    bad, check_len, cuda_err, threads_for, to_i32, CudaDevice, KvPool, PoolShape, TokenMaps,
};
use crate::error::EngineError;

impl CudaDevice {
    /// Per-head RMSNorm (when `q_norm`/`k_norm` are given, each `head_dim` long) and RoPE in
    /// place on the first `nq + nkv` heads of each of the `maps.tokens` rows of `qkv` (rows
    /// `row_stride` apart). `inv_freq` holds `head_dim / 2` frequencies (as f32).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        nq: usize,
        nkv: usize,
        head_dim: usize,
        maps: &TokenMaps,
        inv_freq: &CudaSlice<f32>,
        q_norm: Option<&CudaSlice<f32>>,
        k_norm: Option<&CudaSlice<f32>>,
        eps: f32,
    ) -> Result<(), EngineError> {
        let heads = HeadNorms {
            nq,
            nkv,
            head_dim,
            inv_freq,
            q_norm,
            k_norm,
            eps,
        };
        self.qk_norm_rope_into(qkv, row_stride, &heads, maps, None)
    }

    /// [`Self::qk_norm_rope`], then the rotated K and the V heads (after the k heads in each
    /// row) stored into `layer` of the pool: the KV write of [`Self::kv_write`] in the same
    /// launch.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_kv(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        pool: &mut KvPool,
        shape: PoolShape,
        layer: usize,
    ) -> Result<(), EngineError> {
        self.qk_norm_rope_kv_split_input(qkv, false, row_stride, heads, maps, pool, shape, layer)
    }

    /// [`Self::qk_norm_rope_kv`] over a split GEMM's unfolded output when `unfolded` (hi rows,
    /// then as many lo rows): each value is read as hi + lo, the q and k heads written back
    /// folded (the v heads' hi rows stay as they are; the pool holds them folded).
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_kv_split_input(
        &self,
        qkv: &mut CudaSlice<f32>,
        unfolded: bool,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        pool: &mut KvPool,
        shape: PoolShape,
        layer: usize,
    ) -> Result<(), EngineError> {
        heads.check_pool("qk_norm_rope_kv", row_stride, pool, shape, layer)?;
        let in_lo = if unfolded {
            check_len(
                "qk_norm_rope_kv qkv",
                qkv.len(),
                2 * maps.tokens * row_stride,
            )?;
            maps.tokens * row_stride
        } else {
            0
        };
        self.qk_norm_rope_into(
            qkv,
            row_stride,
            heads,
            maps,
            Some((pool, shape, layer, in_lo)),
        )
    }

    fn qk_norm_rope_into(
        &self,
        qkv: &mut CudaSlice<f32>,
        row_stride: usize,
        heads: &HeadNorms<'_>,
        maps: &TokenMaps,
        pool: Option<(&mut KvPool, PoolShape, usize, usize)>,
    ) -> Result<(), EngineError> {
        let HeadNorms {
            nq,
            nkv,
            head_dim,
            inv_freq,
            q_norm,
            k_norm,
            eps,
        } = *heads;
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        if !head_dim.is_multiple_of(2) || (nq + nkv) * head_dim > row_stride {
            return Err(bad(format!(
                "qk_norm_rope: head_dim {head_dim}, {nq}+{nkv} heads, row stride {row_stride}"
            )));
        }
        check_len("qk_norm_rope qkv", qkv.len(), t * row_stride)?;
        heads.check_lengths("qk_norm_rope")?;
        let (rs, q, kv, hd) = (
            to_i32("row stride", row_stride)?,
            to_i32("nq", nq)?,
            to_i32("nkv", nkv)?,
            to_i32("head_dim", head_dim)?,
        );
        let null = 0u64;
        let grid_heads = if pool.is_some() {
            nq + 2 * nkv
        } else {
            nq + nkv
        };
        let cfg = LaunchConfig {
            grid_dim: (t as u32, grid_heads as u32, 1),
            block_dim: (threads_for(head_dim / 2), 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match &pool {
            None => "qk_norm_rope_f32",
            Some((KvPool::F32(_), ..)) => "qk_norm_rope_kv_f32",
            Some((KvPool::Bf16(_), ..)) => "qk_norm_rope_kv_bf16",
            Some((KvPool::Half(_), ..)) => "qk_norm_rope_kv_h16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv).arg(&rs).arg(&q);
        if pool.is_some() {
            b.arg(&kv);
        }
        b.arg(&hd).arg(&maps.positions).arg(inv_freq);
        for n in [q_norm, k_norm] {
            match n {
                Some(n) => b.arg(n),
                None => b.arg(&null),
            };
        }
        b.arg(&eps);
        let (tail, in_lo);
        if let Some((pool, shape, layer, lo)) = pool {
            tail = [
                to_i32("block size", shape.block_size)?,
                to_i32("layer", layer)?,
                to_i32("layers", shape.num_layers)?,
            ];
            in_lo = lo as i64;
            match pool {
                KvPool::F32(p) => b.arg(p),
                KvPool::Bf16(p) | KvPool::Half(p) => b.arg(p),
            };
            b.arg(&maps.token_block)
                .arg(&tail[0])
                .arg(&tail[1])
                .arg(&tail[2])
                .arg(&in_lo);
        }
        // SAFETY: signature matches (the pool arguments only for the _kv kernels); shapes
        // checked above; with a pool, it holds the whole shape and the block ids come from
        // tables the caller validated against `shape.num_blocks`.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching qk_norm_rope"))?;
        Ok(())
    }

    /// Stores the K and V of every token of `maps` (in `qkv` at column `k_off`, K then V,
    /// `num_kv_heads * head_dim` each) into `layer` of the pool, at the layout's address.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        pool: &mut KvPool,
        shape: PoolShape,
        layer: usize,
        qkv: &CudaSlice<f32>,
        row_stride: usize,
        k_off: usize,
        maps: &TokenMaps,
    ) -> Result<(), EngineError> {
        let t = maps.tokens;
        if t == 0 {
            return Ok(());
        }
        let kvd = shape.num_kv_heads * shape.head_dim;
        if k_off + 2 * kvd > row_stride || layer >= shape.num_layers {
            return Err(bad(format!(
                "kv_write: k offset {k_off} + 2×{kvd} over row stride {row_stride}, or layer {layer} ≥ {}",
                shape.num_layers
            )));
        }
        check_len("kv_write pool", pool.len(), shape.elems())?;
        check_len("kv_write qkv", qkv.len(), t * row_stride)?;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (threads_for(kvd).min(256), 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            to_i32("row stride", row_stride)?,
            to_i32("k offset", k_off)?,
            to_i32("kv width", kvd)?,
        ];
        let tail = [
            to_i32("block size", shape.block_size)?,
            to_i32("layer", layer)?,
            to_i32("layers", shape.num_layers)?,
        ];
        let name = match pool {
            KvPool::F32(_) => "kv_write_f32",
            KvPool::Bf16(_) => "kv_write_bf16",
            KvPool::Half(_) => "kv_write_h16",
        };
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        match pool {
            KvPool::F32(p) => b.arg(p),
            KvPool::Bf16(p) | KvPool::Half(p) => b.arg(p),
        };
        b.arg(qkv)
            .arg(&args[0])
            .arg(&args[1])
            .arg(&args[2])
            .arg(&maps.token_block)
            .arg(&maps.positions)
            .arg(&tail[0])
            .arg(&tail[1])
            .arg(&tail[2]);
        // SAFETY: signature matches; the pool holds the whole shape (checked) and the block
        // ids come from tables the caller validated against `shape.num_blocks`.
        unsafe { b.launch(cfg) }.map_err(cuda_err("launching kv_write"))?;
        Ok(())
    }
}
