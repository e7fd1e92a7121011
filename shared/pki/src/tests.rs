use super::*;

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tandem-pki-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(feature = "generate")]
#[test]
fn generated_folder_loads_and_is_kept() {
    let s = Scratch::new("gen");
    assert_eq!(
        generate(&s.0, &["10.0.0.1".into()]).unwrap(),
        Generated::Created
    );
    let id = InternalIdentity::load(&s.0).unwrap();
    assert_eq!(id.dir(), s.0.as_path());
    let before = std::fs::read(s.0.join(CERT_FILE)).unwrap();
    assert_eq!(generate(&s.0, &[]).unwrap(), Generated::Existing);
    assert_eq!(std::fs::read(s.0.join(CERT_FILE)).unwrap(), before);
    // No CA key is ever written.
    let mut names: Vec<_> = std::fs::read_dir(&s.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, [CA_FILE, CERT_FILE, KEY_FILE]);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(s.0.join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "key readable by others: {mode:o}");
    }
    // The key never shows in Debug output.
    let shown = format!("{id:?}");
    assert!(
        shown.contains("redacted") && !shown.contains("PRIVATE KEY"),
        "{shown}"
    );
}

#[cfg(feature = "generate")]
#[test]
fn incomplete_folder_is_refused() {
    let s = Scratch::new("incomplete");
    generate(&s.0, &[]).unwrap();
    std::fs::remove_file(s.0.join(KEY_FILE)).unwrap();
    assert!(matches!(generate(&s.0, &[]), Err(PkiError::Incomplete(..))));
    match InternalIdentity::load(&s.0) {
        Err(PkiError::Read { path, .. }) => assert_eq!(path, s.0.join(KEY_FILE)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_pem_names_the_file() {
    let s = Scratch::new("bad");
    std::fs::create_dir_all(&s.0).unwrap();
    std::fs::write(s.0.join(CA_FILE), "not a certificate\n").unwrap();
    match InternalIdentity::load(&s.0) {
        Err(PkiError::NoPem { path, what }) => {
            assert_eq!(path, s.0.join(CA_FILE));
            assert_eq!(what, "certificate");
        }
        other => panic!("{other:?}"),
    }
    let garbled = "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
    std::fs::write(s.0.join(CA_FILE), garbled).unwrap();
    assert!(matches!(
        InternalIdentity::load(&s.0),
        Err(PkiError::BadPem { .. })
    ));
}

#[test]
fn plaintext_endpoints_are_http_and_tls_ones_https() {
    let plain = ChannelSecurity::Plaintext;
    assert_eq!(
        plain.endpoint("127.0.0.1:5").unwrap().uri().scheme_str(),
        Some("http")
    );
    assert!(plain.server_tls().is_none());
    assert!(matches!(
        plain.endpoint("bad address with spaces"),
        Err(PkiError::Address { .. })
    ));
}

#[cfg(feature = "generate")]
#[test]
fn tls_endpoints_are_https() {
    let s = Scratch::new("https");
    generate(&s.0, &[]).unwrap();
    let tls = ChannelSecurity::from_dir(Some(&s.0)).unwrap();
    assert!(tls.is_tls());
    assert_eq!(
        tls.endpoint("127.0.0.1:5").unwrap().uri().scheme_str(),
        Some("https")
    );
    assert!(tls.server_tls().is_some());
}

#[cfg(feature = "generate")]
#[test]
fn concurrent_generation_agrees_on_one_folder() {
    let s = Scratch::new("race");
    let results: Vec<Generated> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| generate(&s.0, &[]).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        results.iter().filter(|r| **r == Generated::Created).count(),
        1
    );
    InternalIdentity::load(&s.0).unwrap();
    // No staging folder is left beside it.
    let parent = s.0.parent().unwrap();
    let name = s.0.file_name().unwrap().to_string_lossy().into_owned();
    let leftovers = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.new-"))
        })
        .count();
    assert_eq!(leftovers, 0);
}
