//! Test certificates (feature `tls`): a CA made in the test, server certificates with a chosen
//! serial for `localhost` and `127.0.0.1`, and client certificates, all ECDSA P-256 as PEM.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    SerialNumber,
};

/// A certificate authority that lives as long as the test.
pub struct TestCa {
    key: KeyPair,
    cert: rcgen::Certificate,
}

/// A certificate the CA signed, with its key.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    /// The certificate's DER (what a TLS peer presents).
    pub der: Vec<u8>,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("a P-256 key is generated");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names is valid");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params
            .self_signed(&key)
            .expect("a CA certificate is signed");
        Self { key, cert }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub fn der(&self) -> Vec<u8> {
        self.cert.der().to_vec()
    }

    /// A server certificate for `localhost` and `127.0.0.1` with this serial number.
    pub fn server(&self, serial: u64) -> Issued {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("the names are valid");
        params.serial_number = Some(SerialNumber::from(serial));
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names is valid");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Issued {
        let key = KeyPair::generate().expect("a P-256 key is generated");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("the CA signs");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }
}

impl Issued {
    /// Writes the certificate and the key (each replaced at once: written beside, then renamed,
    /// as a secret volume or cert-manager swaps them).
    pub fn write(&self, cert: &Path, key: &Path) {
        for (path, text) in [(cert, &self.cert_pem), (key, &self.key_pem)] {
            let next = path.with_extension("next");
            std::fs::write(&next, text).expect("the test folder is writable");
            std::fs::rename(&next, path).expect("the test folder is writable");
        }
    }

    /// The certificate and key in one PEM (what `reqwest::Identity::from_pem` reads).
    pub fn identity_pem(&self) -> String {
        format!("{}{}", self.cert_pem, self.key_pem)
    }
}
