//! A producer's certificate identity: the URI (SPIFFE) and DNS names of its client certificate's
//! subjectAltName, read once per connection at the end of the TLS handshake.

use std::sync::Arc;

use x509_parser::extensions::GeneralName;

use crate::limits::MAX_PRODUCER_IDENTITY_NAMES;

/// The names a verified client certificate vouches for, attached to every request of its
/// connection (a request extension). Never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCertificate(pub Arc<[String]>);

/// The SAN URI and DNS names of a DER certificate (at most [`MAX_PRODUCER_IDENTITY_NAMES`], in
/// certificate order); `None` when it has none or cannot be parsed.
pub fn certificate_names(der: &[u8]) -> Option<PeerCertificate> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let names: Vec<String> = san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(u.to_string()),
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .take(MAX_PRODUCER_IDENTITY_NAMES)
        .collect();
    (!names.is_empty()).then(|| PeerCertificate(names.into()))
}

/// The identity of the peer of a finished server handshake, if it presented a certificate.
pub fn of_connection(conn: &rustls::ServerConnection) -> Option<PeerCertificate> {
    certificate_names(conn.peer_certificates()?.first()?.as_ref())
}
