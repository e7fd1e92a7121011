//! Fences over a GPU pool's blocks: when the work that wrote them is complete, so that a
//! GPU-to-GPU writer reads them without a device-wide wait.
//!
//! Two kinds: a fence after the work queued so far ([`BlocksReady::Whole`]), and fences
//! armed for the *next* step, one per group of layers ([`BlocksReady::Layers`]), which the
//! backend resolves as that step's launches pass each group's last layer. The second lets a
//! prefill's blocks leave layer group by layer group while the step still computes the rest.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::EngineError;

/// Tells when the GPU work recorded before it (the step that wrote some blocks) is complete.
pub trait DeviceFence: Send + Sync {
    /// Blocks the calling thread until that work is complete.
    fn wait(&self) -> Result<(), EngineError>;
}

/// One group of layers of some blocks (`layers`, a range of the layout's layers) and the
/// fence after which their K/V are final.
#[derive(Clone)]
pub struct LayerFence {
    pub layers: Range<usize>,
    pub fence: Arc<dyn DeviceFence>,
}

impl std::fmt::Debug for LayerFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerFence")
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}

/// When handed-out blocks may be read.
pub enum BlocksReady {
    /// Every layer of every block, once this fence has passed.
    Whole(Box<dyn DeviceFence>),
    /// Layer groups in order, covering every layer once: group `g`'s layers of every block
    /// (a contiguous `layers.len() * layer_bytes` bytes at `block + layers.start *
    /// layer_bytes`, the layout being block-major with layers inside) once its fence has
    /// passed.
    Layers {
        layer_bytes: usize,
        groups: Vec<LayerFence>,
    },
}

impl std::fmt::Debug for BlocksReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlocksReady::Whole(_) => f.write_str("Whole"),
            BlocksReady::Layers {
                layer_bytes,
                groups,
            } => f
                .debug_struct("Layers")
                .field("layer_bytes", layer_bytes)
                .field("groups", groups)
                .finish(),
        }
    }
}

/// The layer groups of a model of `num_layers` layers cut into `groups` (at least 1, at most
/// one per layer) runs of nearly equal length, in order.
pub fn layer_groups(num_layers: usize, groups: usize) -> Vec<Range<usize>> {
    let g = groups.clamp(1, num_layers.max(1));
    (0..g)
        .map(|i| i * num_layers / g..(i + 1) * num_layers / g)
        .filter(|r| !r.is_empty())
        .collect()
}

enum Slot {
    Armed,
    Set(Box<dyn DeviceFence>),
    /// The step ended (or failed) without reaching the point the fence stands for.
    Abandoned,
}

/// A fence armed before the step it belongs to runs: [`DeviceFence::wait`] blocks until the
/// backend has recorded the real fence ([`PendingFenceSetter::set`]), then waits for that.
/// If the setter is dropped unset (the step failed or never ran), `wait` fails.
pub struct PendingFence {
    slot: Arc<(Mutex<Slot>, Condvar)>,
}

/// The backend's half of a [`PendingFence`].
pub struct PendingFenceSetter {
    slot: Arc<(Mutex<Slot>, Condvar)>,
}

/// A fence to be recorded later, and the handle that records it.
pub fn pending_fence() -> (PendingFence, PendingFenceSetter) {
    let slot = Arc::new((Mutex::new(Slot::Armed), Condvar::new()));
    (
        PendingFence { slot: slot.clone() },
        PendingFenceSetter { slot },
    )
}

impl PendingFenceSetter {
    /// The point is reached: waiters now wait for `fence`.
    pub fn set(self, fence: Box<dyn DeviceFence>) {
        self.resolve(Slot::Set(fence));
    }

    fn resolve(&self, to: Slot) {
        let (lock, cv) = &*self.slot;
        let mut slot = lock.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*slot, Slot::Armed) {
            *slot = to;
            cv.notify_all();
        }
    }
}

impl Drop for PendingFenceSetter {
    fn drop(&mut self) {
        self.resolve(Slot::Abandoned);
    }
}

impl DeviceFence for PendingFence {
    fn wait(&self) -> Result<(), EngineError> {
        let (lock, cv) = &*self.slot;
        let mut slot = lock.lock().unwrap_or_else(|p| p.into_inner());
        while matches!(*slot, Slot::Armed) {
            slot = cv.wait(slot).unwrap_or_else(|p| p.into_inner());
        }
        match &*slot {
            Slot::Set(fence) => fence.wait(),
            Slot::Armed | Slot::Abandoned => Err(EngineError::Backend(
                "the step that was to write these KV layers ended without writing them".into(),
            )),
        }
    }
}

/// Layer fences armed for a backend's next step: the fences handed out, and their setters
/// by the layer after which each is recorded.
pub struct ArmedLayers {
    fences: Vec<LayerFence>,
    /// `(end layer, setter)`, in layer order.
    setters: Vec<(usize, PendingFenceSetter)>,
}

impl ArmedLayers {
    /// Fences for the `groups` layer groups of a model of `num_layers` layers.
    pub fn new(num_layers: usize, groups: usize) -> Self {
        let mut fences = Vec::new();
        let mut setters = Vec::new();
        for layers in layer_groups(num_layers, groups) {
            let (fence, setter) = pending_fence();
            setters.push((layers.end, setter));
            fences.push(LayerFence {
                layers,
                fence: Arc::new(fence),
            });
        }
        ArmedLayers { fences, setters }
    }

    /// The fences, for another handout in the same step.
    pub fn fences(&self) -> Vec<LayerFence> {
        self.fences.clone()
    }

    /// The setters, for the step to record (dropping the fences' own copies: only handed-out
    /// ones keep them).
    pub fn into_setters(self) -> LayerMarks {
        LayerMarks(self.setters)
    }
}

/// The setters a running step resolves as its launches pass each group's last layer.
#[derive(Default)]
pub struct LayerMarks(Vec<(usize, PendingFenceSetter)>);

impl LayerMarks {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Resolves, with fences from `record`, every mark of a group that ends at or before
    /// `layers_done` layers.
    pub fn passed(
        &mut self,
        layers_done: usize,
        mut record: impl FnMut() -> Result<Box<dyn DeviceFence>, EngineError>,
    ) -> Result<(), EngineError> {
        while self.0.first().is_some_and(|(end, _)| *end <= layers_done) {
            let (_, setter) = self.0.remove(0);
            setter.set(record()?);
        }
        Ok(())
    }

    /// Resolves every remaining mark (the step's work is all queued).
    pub fn finish(
        &mut self,
        record: impl FnMut() -> Result<Box<dyn DeviceFence>, EngineError>,
    ) -> Result<(), EngineError> {
        self.passed(usize::MAX, record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Passed;
    impl DeviceFence for Passed {
        fn wait(&self) -> Result<(), EngineError> {
            Ok(())
        }
    }

    #[test]
    fn layer_groups_cover_every_layer_once_in_order() {
        assert_eq!(layer_groups(28, 4), vec![0..7, 7..14, 14..21, 21..28]);
        assert_eq!(layer_groups(28, 3), vec![0..9, 9..18, 18..28]);
        assert_eq!(layer_groups(2, 8), vec![0..1, 1..2]);
        assert_eq!(layer_groups(5, 0), vec![0..5]);
        for (n, g) in [(1, 1), (7, 3), (28, 28), (36, 5)] {
            let flat: Vec<usize> = layer_groups(n, g).into_iter().flatten().collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "{n} layers in {g}");
        }
    }

    #[test]
    fn a_pending_fence_waits_for_its_setter_on_another_thread() {
        let (fence, setter) = pending_fence();
        let waiter = std::thread::spawn(move || fence.wait());
        setter.set(Box::new(Passed));
        assert!(waiter.join().unwrap().is_ok());
    }

    #[test]
    fn an_abandoned_fence_fails_its_waiters() {
        let armed = ArmedLayers::new(4, 2);
        let fences = armed.fences();
        let mut marks = armed.into_setters();
        // The first group is recorded; the step then fails before the second.
        marks.passed(2, || Ok(Box::new(Passed))).unwrap();
        drop(marks);
        assert!(fences[0].fence.wait().is_ok());
        let e = fences[1].fence.wait().unwrap_err();
        assert!(matches!(e, EngineError::Backend(_)), "{e:?}");
    }

    #[test]
    fn marks_resolve_in_layer_order_and_finish_resolves_the_rest() {
        let armed = ArmedLayers::new(6, 3);
        let fences = armed.fences();
        let mut marks = armed.into_setters();
        let mut recorded = 0;
        marks
            .passed(1, || {
                recorded += 1;
                Ok(Box::new(Passed))
            })
            .unwrap();
        assert_eq!(recorded, 0, "no group ends at layer 1");
        marks
            .passed(2, || {
                recorded += 1;
                Ok(Box::new(Passed))
            })
            .unwrap();
        assert_eq!(recorded, 1);
        marks
            .finish(|| {
                recorded += 1;
                Ok(Box::new(Passed))
            })
            .unwrap();
        assert_eq!(recorded, 3);
        assert!(marks.is_empty());
        assert!(fences.iter().all(|f| f.fence.wait().is_ok()));
    }
}
