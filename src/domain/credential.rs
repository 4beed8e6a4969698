//! The credential policy: Seal refuses a form that asks for a password,
//! token, key or payment credential (the MCP specification's MUST NOT)
//! under the `deny` policy (the default), logs it under `warn`, does not
//! look under `off`. Looked at, where an answer could carry a secret (a
//! free-text or number field, not a yes/no or a choice among fixed
//! options): the field's name, title, description and option titles, and
//! the form's message. `Manifest::build` applies it to every form.
//!
//! The check is a word list matched after normalization (NFKC, the Unicode
//! TR39 confusable skeleton, accents and invisible characters dropped,
//! leetspeak read as letters): defence in depth, not a guarantee.

use serde_json::{Map, Value};

/// What Seal does with a form field that asks for a credential.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CredentialPolicy {
    /// Refuse the seal with BAD_INPUT_REQUESTS (the specification's MUST NOT).
    #[default]
    Deny,
    /// Seal, and log a warning with the field name.
    Warn,
    /// Do not look.
    Off,
}

impl CredentialPolicy {
    /// Whether Seal may go on with a form one of whose texts may name a
    /// credential (`asks`, not called under `off`): under `deny`, not if
    /// it does; under `warn`, yes, with `label` (the field's name, or
    /// `(message)`) added to `warned`.
    pub fn admits(
        self,
        label: &str,
        asks: impl FnOnce() -> bool,
        warned: &mut Vec<String>,
    ) -> bool {
        if self == CredentialPolicy::Off || !asks() {
            return true;
        }
        if self == CredentialPolicy::Deny {
            return false;
        }
        warned.push(label.to_owned());
        true
    }
}

/// Whether a form field asks for a credential: by its name, or by any text
/// of its definition `def` a user reads ([`field_texts`]).
pub fn field_looks_like_credential(name: &str, def: &Map<String, Value>) -> bool {
    looks_like_credential(name) || field_texts(def).into_iter().any(looks_like_credential)
}

/// Credential words, matched against whole words of a text and against
/// two or three adjacent words written together (`api_key`, `apiKey`,
/// `API key` and `apikey` are all `apikey`), after [`normalize`]: so
/// `secretary_name` and `max_tokens` pass, `client_secret` does not. English,
/// German, Spanish, French, Portuguese, Italian and Dutch.
const CREDENTIAL_WORDS: &[&str] = &[
    // passwords and passphrases
    "password",
    "passwords",
    "passwd",
    "passphrase",
    "passcode",
    "pwd",
    "passwort",
    "kennwort",
    "contrasena",
    "clave",
    "motdepasse",
    "senha",
    "palavrapasse",
    "parolachiave",
    "paroladordine",
    "wachtwoord",
    "secret",
    "clientsecret",
    "secretphrase",
    "passworter",
    "kennworter",
    "contrasenas",
    "claves",
    "motsdepasse",
    "senhas",
    "palavraspasse",
    "wachtwoorden",
    "secrets",
    // keys and tokens
    "apikey",
    "accesskey",
    "privatekey",
    "secretkey",
    "sshkey",
    "signingkey",
    "encryptionkey",
    "credential",
    "credentials",
    "bearertoken",
    "accesstoken",
    "authtoken",
    "refreshtoken",
    "sessiontoken",
    "idtoken",
    "apitoken",
    "securitytoken",
    "githubtoken",
    "gitlabtoken",
    "slacktoken",
    "personalaccesstoken",
    "sessioncookie",
    "authcookie",
    "sessionid",
    "jwt",
    // payment cards and accounts
    "cardnumber",
    "creditcard",
    "debitcard",
    "cardpan",
    "primaryaccountnumber",
    "kartennummer",
    "kreditkarte",
    "numerodetarjeta",
    "tarjetadecredito",
    "numerodecarte",
    "cartebancaire",
    "cartedecredit",
    "numerodocartao",
    "cartaodecredito",
    "numerodicarta",
    "cartadicredito",
    "kaartnummer",
    "iban",
    "bankaccountnumber",
    "kontonummer",
    "numerodecuenta",
    "numerodecompte",
    "numerodaconta",
    "numerodiconto",
    "rekeningnummer",
    // card security codes
    "cvv",
    "cvv2",
    "cvc",
    "cvc2",
    "cardcvv",
    "cardcvc",
    "securitycode",
    "cardcode",
    "pruefnummer",
    "prufnummer",
    "kartenpruefnummer",
    "kartenprufnummer",
    "codigodeseguridad",
    "cryptogramme",
    "codigodeseguranca",
    "codicedisicurezza",
    "beveiligingscode",
    // PINs and one-time codes
    "pin",
    "pincode",
    "pinnummer",
    "geheimzahl",
    "codigopin",
    "otp",
    "totp",
    "hotp",
    "onetimecode",
    "onetimepassword",
    "onetimepasscode",
    "2fa",
    "2facode",
    "mfa",
    "mfacode",
    "verificationcode",
    "authcode",
    "authenticationcode",
    "smscode",
    "recoverycode",
    "backupcode",
    "codigodeverificacion",
    "bestaetigungscode",
    "bestatigungscode",
    // wallets
    "seedphrase",
    "recoveryphrase",
    "mnemonic",
    "mnemonicphrase",
    "walletseed",
    "seedwords",
];

/// Words that name a credential only as a whole text (a field named
/// `token` or `PAN`), never inside a longer one (`token_count`, `pan_size`).
const CREDENTIAL_ALONE: &[&str] = &["token", "pan", "bearer"];

/// Credential words of scripts written without spaces (Japanese, Chinese),
/// matched anywhere in the normalized text.
const CREDENTIAL_CJK: &[&str] = &[
    "パスワード",
    "暗証番号",
    "カード番号",
    "クレジットカード",
    "セキュリティコード",
    "認証コード",
    "秘密鍵",
    "合言葉",
    "密码",
    "密碼",
    "口令",
    "卡号",
    "卡號",
    "信用卡",
    "银行卡",
    "銀行卡",
    "安全码",
    "安全碼",
    "验证码",
    "驗證碼",
    "私钥",
    "私鑰",
    "助记词",
    "助記詞",
];

/// What credential matching compares: NFKC, lowercase, the Unicode TR39
/// confusable skeleton (so Cyrillic `а`, fullwidth letters and `0`-for-`o`
/// read as the letters they imitate), accents removed, lowercase again.
fn normalize(text: &str) -> String {
    use unicode_normalization::UnicodeNormalization;
    let folded: String = text.nfkc().flat_map(char::to_lowercase).collect();
    let skeleton: String = unicode_security::skeleton(&folded).collect();
    skeleton
        .nfkd()
        .filter(|c| !unicode_normalization::char::is_combining_mark(*c))
        .flat_map(char::to_lowercase)
        .collect()
}

/// The words of a text: split at anything but letters and digits and at
/// lowercase-to-uppercase steps (`apiKey`), each normalized; `@` and `$`
/// and, inside a word with letters, `3 4 5 7` read as the letters they
/// stand for in leetspeak.
fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in text.chars() {
        // Invisible characters (zero-width spaces, soft hyphens, joiners)
        // and combining marks belong to the word they sit in.
        if is_default_ignorable(c) {
            continue;
        }
        if unicode_normalization::char::is_combining_mark(c) {
            cur.push(c);
            continue;
        }
        let c = match c {
            '@' => 'a',
            '$' => 's',
            c => c,
        };
        if !c.is_alphanumeric() {
            out.push(std::mem::take(&mut cur));
            prev_lower = false;
            continue;
        }
        if c.is_uppercase() && prev_lower {
            out.push(std::mem::take(&mut cur));
        }
        prev_lower = c.is_lowercase();
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .filter(|w| !w.is_empty())
        .map(|w| {
            let w = normalize(&w);
            if w.chars().any(char::is_alphabetic) {
                w.chars()
                    .map(|c| match c {
                        '3' => 'e',
                        '4' => 'a',
                        '5' => 's',
                        '7' => 't',
                        c => c,
                    })
                    .collect()
            } else {
                w
            }
        })
        .collect()
}

/// Unicode's default-ignorable code points (DerivedCoreProperties): shown
/// as nothing, so `pass\u{200b}word` reads as `password`.
fn is_default_ignorable(c: char) -> bool {
    matches!(c as u32,
        0x00AD | 0x034F | 0x061C | 0x115F..=0x1160 | 0x17B4..=0x17B5 | 0x180B..=0x180F
        | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x206F | 0x3164 | 0xFE00..=0xFE0F
        | 0xFEFF | 0xFFA0 | 0xFFF0..=0xFFF8 | 0x1BCA0..=0x1BCA3 | 0x1D173..=0x1D17A
        | 0xE0000..=0xE0FFF)
}

fn credential_sets() -> &'static (
    std::collections::HashSet<String>,
    std::collections::HashSet<String>,
    Vec<String>,
) {
    static SETS: std::sync::OnceLock<(
        std::collections::HashSet<String>,
        std::collections::HashSet<String>,
        Vec<String>,
    )> = std::sync::OnceLock::new();
    SETS.get_or_init(|| {
        (
            CREDENTIAL_WORDS.iter().map(|w| normalize(w)).collect(),
            CREDENTIAL_ALONE.iter().map(|w| normalize(w)).collect(),
            CREDENTIAL_CJK.iter().map(|w| normalize(w)).collect(),
        )
    })
}

/// Whether a text (a field's name, title or description, an option's
/// title, or the question's message) names a credential. Defence in depth,
/// not a guarantee: docs/token-format.md ("The sealed manifest of what was
/// asked") says what no word list can catch.
pub fn looks_like_credential(text: &str) -> bool {
    let (words_set, alone, cjk) = credential_sets();
    let w = words(text);
    let joined: String = w.concat();
    if alone.contains(&joined) {
        return true;
    }
    for n in 1..=3 {
        if w.windows(n).any(|g| words_set.contains(&g.concat())) {
            return true;
        }
    }
    let visible: String = text.chars().filter(|c| !is_default_ignorable(*c)).collect();
    let whole = normalize(&visible);
    cjk.iter().any(|c| whole.contains(c.as_str()))
}

/// Every text of a field definition a user reads: its title and
/// description, and the titles of its options (`oneOf`, `anyOf` of
/// `items`, legacy `enumNames`).
fn field_texts(def: &Map<String, Value>) -> Vec<&str> {
    let mut texts: Vec<&str> = ["title", "description"]
        .iter()
        .filter_map(|k| def.get(*k).and_then(Value::as_str))
        .collect();
    let options = def
        .get("oneOf")
        .or_else(|| def.get("items").and_then(|i| i.get("anyOf")));
    if let Some(Value::Array(opts)) = options {
        texts.extend(
            opts.iter()
                .filter_map(|o| o.get("title").and_then(Value::as_str)),
        );
    }
    if let Some(Value::Array(names)) = def.get("enumNames") {
        texts.extend(names.iter().filter_map(Value::as_str));
    }
    texts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::manifest::Manifest;

    #[test]
    fn credential_words() {
        for yes in [
            "password",
            "New Password",
            "api_key",
            "API Key",
            "accessToken",
            "card-number",
            "pin",
            "OTP",
            "client_secret",
        ] {
            assert!(looks_like_credential(yes), "{yes}");
        }
        for no in [
            "name",
            "spinner",
            "hotpot",
            "amount",
            "email",
            "confirm",
            "pinned_note",
        ] {
            assert!(!looks_like_credential(no), "{no}");
        }
    }

    /// A form asking `name` (with `def`) under `message`: refused under
    /// the default policy?
    fn refused(message: &str, name: &str, def: Value) -> bool {
        let q = serde_json::json!({"q": {"method": "elicitation/create", "params": {
            "mode": "form", "message": message,
            "requestedSchema": {"type": "object", "properties": {name: def}}}}});
        Manifest::build(&q.to_string(), CredentialPolicy::Deny).is_err()
    }

    /// Invisible characters between every letter of a credential word are
    /// dropped before the check: split at each of them, the word would be
    /// eight one-letter pieces, more than the joins of up to three pieces
    /// the check also tries.
    #[test]
    fn invisible_characters_between_every_letter_are_dropped() {
        let s = serde_json::json!({"type": "string"});
        for sep in ["\u{200b}", "\u{ad}", "\u{2060}", "\u{feff}", "\u{e0020}"] {
            let name: String = "password".chars().map(|c| format!("{c}{sep}")).collect();
            assert!(refused("Sign in", &name, s.clone()), "{name:?}");
        }
        // Letters that render as nothing (Hangul fillers) are refused too.
        for name in ["pass\u{115f}word", "pass\u{3164}word", "pass\u{ffa0}word"] {
            assert!(refused("Sign in", name, s.clone()), "{name:?}");
        }
    }

    #[test]
    fn credential_fields_are_refused_and_harmless_ones_pass() {
        let s = serde_json::json!({"type": "string"});
        let desc = |d: &str| serde_json::json!({"type": "string", "description": d});
        let title = |t: &str| serde_json::json!({"type": "string", "title": t});
        // Issue #36's list, each sealed before.
        assert!(refused("Sign in", "pw", desc("Your bank password")));
        assert!(refused(
            "Please enter the banking password",
            "value",
            s.clone()
        ));
        for name in [
            "passwort",
            "Contraseña",
            "mot_de_passe",
            "p\u{430}ssword",
            "ｐａｓｓｗｏｒｄ",
            "passw0rd",
            "pin_code",
            "cvv2",
            "card_cvv",
            "PAN",
            "one_time_code",
            "bearer",
            "session_cookie",
            "senha",
            "wachtwoord",
            "Kennwort",
            "numero_di_carta",
            "código_de_seguridad",
            "clientSecret",
            "apiKey",
            "x-api-key",
            "p@ssword",
            "pa55word",
            "パスワード",
            "暗証番号",
            "密码",
            "信用卡号",
            "token",
            "access_token",
            "Recovery phrase",
            "pass\u{200b}word",
            "pass\u{ad}word",
            "Passwörter",
            "Kennwörter",
            "Contraseñas",
            "Contrasen\u{303}a",
            "Senhas",
            "Mots de passe",
            "wachtwoorden",
            "Bank account number",
        ] {
            assert!(refused("Fill in", name, s.clone()), "{name}");
        }
        for t in [
            "2FA code",
            "SSH key",
            "Wallet recovery phrase",
            "Card number",
            "Security code",
        ] {
            assert!(refused("Fill in", "f", title(t)), "{t}");
        }
        // A choice among fixed options, or a yes/no, carries no secret,
        // whatever its texts say.
        let opts = serde_json::json!({"type": "string", "oneOf": [
            {"const": "a", "title": "Use my password"}, {"const": "b", "title": "Other"}]});
        assert!(!refused("Choose", "how", opts));
        for t in ["Turn on 2FA?", "Send a password reset email?"] {
            let yes_no = serde_json::json!({"type": "boolean", "title": t});
            assert!(!refused("Fill in", "x", yes_no), "{t}");
        }
        // Harmless names, refused before.
        for name in [
            "secretary_name",
            "max_tokens",
            "token_count",
            "tokenizer",
            "spinner",
            "open_by",
            "keyboard_layout",
            "pan_size",
            "hotpot",
            "topic",
            "company",
            "ring_bearer",
        ] {
            assert!(!refused("Fill in", name, s.clone()), "{name}");
        }
        // A message about a password above a yes/no question carries none.
        let yes_no = serde_json::json!({"type": "boolean"});
        assert!(!refused("Did you change your password?", "done", yes_no));
    }
}
