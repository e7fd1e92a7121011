//! The Tandem router: the OpenAI-compatible HTTP API in front of the workers. It learns
//! workers and their tokenizers from discovery, follows their KV events, applies the chat
//! template, tokenizes, routes with the KV-aware router, streams tokens back as text, and
//! cancels work when clients go away.

#![deny(clippy::too_many_lines, clippy::too_many_arguments)]

pub mod app;
pub mod auth;
pub mod chat;
pub mod completion;
pub mod disagg;
pub mod error;
pub mod events;
pub mod events_nats;
pub mod generate;
pub mod handlers;
pub mod health;
pub mod limits;
pub mod media;
pub mod media_fetch;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod params;
pub mod prepare;
pub mod queue;
pub mod replicas;
pub mod respond;
pub mod server;
pub mod shape;
pub mod structured;
pub mod tenancy;
pub mod tls;
pub mod watcher;
pub mod wire;
