//! Every flag and environment variable of every Tandem role.
