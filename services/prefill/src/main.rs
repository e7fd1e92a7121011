//! `tandem-prefill`: the prefill worker. A thin main over the shared crates.

fn main() {
    tandem_config::entry::refuse_role(
        tandem_config::Role::Prefill,
        "prefill workers are not implemented yet: the prefill→decode KV handoff is still being \
         built; serve aggregated with `tandem-decode --disaggregation-mode agg`",
    );
}
