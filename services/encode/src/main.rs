//! `tandem-encode`: the encode worker. A thin main over the shared crates.

fn main() {
    tandem_config::entry::refuse_role(
        tandem_config::Role::Encode,
        "encode workers are not implemented yet: multimodal (encode) serving is not built",
    );
}
