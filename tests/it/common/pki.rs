//! A throwaway certificate authority for TLS tests (rcgen).

use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair, SanType};

pub struct Ca {
    cert: Certificate,
    key: KeyPair,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        Ca {
            cert: p.self_signed(&key).unwrap(),
            key,
        }
    }

    /// (cert PEM, key PEM) of a leaf with common name `cn` and `sans`.
    pub fn issue_named(&self, cn: &str, sans: Vec<SanType>) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names = sans;
        p.distinguished_name.push(DnType::CommonName, cn);
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// (cert PEM, key PEM) for the given SANs.
    pub fn issue(&self, sans: Vec<SanType>) -> (String, String) {
        self.issue_named("leaf", sans)
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }
}
