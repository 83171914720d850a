//! Generated TLS material for the TLS and TokenReview tests.

/// PEM files of a generated CA and a server certificate it signed (SANs localhost, 127.0.0.1).
pub struct TestPki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Generates a fresh CA and a server certificate/key pair signed by it.
pub fn gen_pki(cn: &str) -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{cn} CA"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

/// A [`TestPki`] plus a client certificate/key pair signed by the same CA (for servers that
/// require client certificates).
pub struct TestPkiWithClient {
    pub pki: TestPki,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

/// Generates a CA, a server pair (SANs localhost, 127.0.0.1) and a client pair (CN `client_cn`,
/// extended key usage client authentication).
pub fn gen_pki_with_client(cn: &str, client_cn: &str) -> TestPkiWithClient {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{cn} CA"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
    client
        .distinguished_name
        .push(DnType::CommonName, client_cn);
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &issuer).unwrap();
    TestPkiWithClient {
        pki: TestPki {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
        client_cert_pem: client_cert.pem(),
        client_key_pem: client_key.serialize_pem(),
    }
}

/// A client certificate and its key (PEM).
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Generates a client CA and one client certificate per entry of `clients`, each with the given
/// subjectAltNames (`scheme://...` → URI SAN, anything else → DNS SAN): (CA PEM, certificates).
pub fn gen_client_certs(cn: &str, clients: &[&[&str]]) -> (String, Vec<ClientCert>) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, SanType,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{cn} client CA"));
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let certs = clients
        .iter()
        .map(|sans| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            params.subject_alt_names = sans
                .iter()
                .map(|s| {
                    let v = (*s).try_into().unwrap();
                    if s.contains("://") {
                        SanType::URI(v)
                    } else {
                        SanType::DnsName(v)
                    }
                })
                .collect();
            let cert = params.signed_by(&key, &issuer).unwrap();
            ClientCert {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
            }
        })
        .collect();
    (ca_cert.pem(), certs)
}
