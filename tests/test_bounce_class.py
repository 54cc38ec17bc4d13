"""Bounce classification (issue 37.3): the shipped rules over replies as the large providers send them, the
rule file's format and its errors (mtaq.core.bounce_class), and a custom file tried before the shipped one."""

from __future__ import annotations

import pytest

from mtaq.core.bounce_class import CATEGORIES, RuleError, classify, combine, default_rules, parse_rules
from mtaq.delivery.relay import split_enhanced

# (reply as received: code, then the text with its enhanced code, as relay.split_enhanced sees it; category).
# Multi-line replies are joined as aiosmtplib gives them (continuation lines keep their enhanced code).
REPLIES = [
    # invalid recipient
    (550, "5.1.1 The email account that you tried to reach does not exist. Please try 5.1.1 double-checking the "
          "recipient's email address for typos or 5.1.1 unnecessary spaces. https://support.google.com/mail/?p="
          "NoSuchUser a1si123 - gsmtp", "invalid_recipient"),  # Gmail
    (550, "5.2.1 The email account that you tried to reach is disabled. https://support.google.com/mail/?p="
          "DisabledUser - gsmtp", "invalid_recipient"),  # Gmail
    (550, "5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup",
     "invalid_recipient"),  # Microsoft 365 (5.1.10 here is not RFC 7505's null MX)
    (550, "5.5.0 Requested action not taken: mailbox unavailable (S2017062302).", "invalid_recipient"),  # Outlook.com
    (554, "delivery error: dd This user doesn't have a yahoo.com account (someone@yahoo.com) [0] - "
          "mta1234.mail.bf1.yahoo.com", "invalid_recipient"),  # Yahoo
    (550, "5.4.1 Recipient address rejected: Access denied. AS(201806281) [DB5EUR03FT012.eop-EUR03.prod.protection."
          "outlook.com]", "invalid_recipient"),  # Microsoft directory-based edge blocking
    (550, "5.1.1 <bob@example.org>: Recipient address rejected: User unknown in virtual mailbox table",
     "invalid_recipient"),  # Postfix
    (550, "No such user here", "invalid_recipient"),  # no enhanced code at all
    # bad domain
    (550, "5.1.2 Host or domain name not found. Name service error for name=nx.example type=MX: Host not found",
     "bad_domain"),  # mtaq's own and Postfix's
    (556, "5.1.10 Domain example.net does not accept mail (nullMX)", "bad_domain"),  # RFC 7505
    (550, "5.4.4 Unrouteable address", "bad_domain"),
    # mailbox full
    (452, "4.2.2 The email account that you tried to reach is over quota. Please direct the recipient to "
          "https://support.google.com/mail/?p=OverQuotaTemp - gsmtp", "mailbox_full"),  # Gmail
    (552, "5.2.2 mailbox full", "mailbox_full"),
    (552, "1 Requested mail action aborted, mailbox is full", "mailbox_full"),  # Yahoo-style, no enhanced code
    (550, "5.0.0 Quota exceeded for user bob", "mailbox_full"),
    # spam block (the sender's IP or domain)
    (550, "5.7.1 Unfortunately, messages from [192.0.2.1] weren't sent. Please contact your Internet service "
          "provider since part of their network is on our block list (S3150).", "spam_block"),  # Outlook.com
    (550, "5.7.1 Service unavailable, Client host [192.0.2.1] blocked using Spamhaus. To request removal from this "
          "list see https://www.spamhaus.org/query/ip/192.0.2.1 (AS3130)", "spam_block"),  # Microsoft 365
    (550, "5.7.606 Access denied, banned sending IP [192.0.2.1]. To request removal from this list please visit "
          "https://sender.office.com/", "spam_block"),  # Microsoft 365
    (550, "5.7.1 [192.0.2.1] Gmail has detected that this message is likely suspicious due to the very low "
          "reputation of the sending domain.", "spam_block"),  # Gmail
    (553, "5.7.2 [TSS09] All messages from 192.0.2.1 will be permanently deferred; Retrying will NOT succeed. "
          "See https://senders.yahooinc.com/error-codes", "spam_block"),  # Yahoo
    # content
    (550, "5.7.1 [192.0.2.1] Our system has detected that this message is likely unsolicited mail. To reduce "
          "the amount of spam sent to Gmail, this message has been blocked.", "content_related"),  # Gmail
    (554, "5.7.1 Message rejected as spam by Content Filtering.", "content_related"),
    (552, "5.7.0 This message was blocked because its content presents a potential security issue.",
     "content_related"),  # Gmail
    (554, "5.6.1 Virus found in message: Eicar-Test-Signature", "content_related"),
    # policy
    (554, "5.7.1 <bob@example.org>: Relay access denied", "policy_related"),  # Postfix
    (550, "5.7.1 The IP you're using to send mail is not authorized to send email directly to our servers. "
          "Please use the SMTP relay at your service provider instead.", "policy_related"),  # Gmail
    (554, "5.7.9 Message not accepted for policy reasons. See https://help.yahoo.com/kb/postmaster/SLN7253.html",
     "policy_related"),  # Yahoo
    (553, "5.1.8 <alice@example.com>: Sender address rejected: Domain not found", "bad_domain"),  # sender's domain
    # authentication (SPF / DKIM / DMARC)
    (550, "5.7.26 Unauthenticated email from example.com is not accepted due to domain's DMARC policy. Please "
          "contact the administrator of example.com domain if this was a legitimate mail.", "authentication_failed"),
    (550, "5.7.26 This mail has been blocked because the sender is unauthenticated. Gmail requires all senders "
          "to authenticate with either SPF or DKIM.", "authentication_failed"),  # Gmail
    (550, "5.7.509 Access denied, sending domain example.com does not pass DMARC verification and has a DMARC "
          "policy of reject.", "authentication_failed"),  # Microsoft 365
    (550, "5.7.23 The message was rejected because of Sender Policy Framework violation", "authentication_failed"),
    (421, "4.7.26 This mail has been rate limited because it is unauthenticated.", "authentication_failed"),  # Gmail
    (535, "5.7.8 Username and Password not accepted.", "authentication_failed"),
    # rate limited
    (421, "4.7.0 [192.0.2.1 15] Our system has detected an unusual rate of unsolicited mail originating from your "
          "IP address. To protect our users from spam, mail sent from your IP address has been temporarily rate "
          "limited.", "rate_limited"),  # Gmail
    (421, "4.7.0 [TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected volume or user "
          "complaints - 4.16.55.1; see https://senders.yahooinc.com/error-codes", "rate_limited"),  # Yahoo
    (451, "4.7.650 The mail server [192.0.2.1] has been temporarily rate limited due to IP reputation.",
     "rate_limited"),  # Microsoft
    (421, "4.3.2 Too many connections from your host, try again later", "rate_limited"),
    (452, "4.5.3 Too many recipients", "rate_limited"),
    # too large
    (552, "5.2.3 Your message exceeded Google's message size limits. Please visit https://support.google.com/mail/"
          "?p=MaxSizeError - gsmtp", "message_too_large"),  # Gmail
    (552, "5.3.4 Message size exceeds fixed maximum message size", "message_too_large"),
    (552, "Message size exceeds maximum permitted", "message_too_large"),
    # TLS
    (530, "5.7.0 Must issue a STARTTLS command first. a1si123 - gsmtp", "tls_required"),  # Gmail
    (450, "4.7.4 TLS is required, but was not offered by host mx.example.org[192.0.2.25]", "tls_required"),  # mtaq
    (450, "4.7.5 Server certificate not verified: host mx.example.org: hostname mismatch", "tls_required"),  # mtaq
    (554, "5.7.10 Encryption needed", "tls_required"),
    # expired
    (451, "4.4.7 message delivery time expired", "message_expired"),
    # transient
    (421, "4.4.1 connect to mx.example.org[192.0.2.25]:25: Connection refused", "transient"),  # mtaq
    (451, "4.4.3 Host or domain name not found. example.org: timed out", "transient"),  # DNS, temporary
    (451, "4.3.0 Temporary local problem, please try again", "transient"),
    (450, "4.2.0 <bob@example.org>: Recipient address rejected: Greylisted, see https://postgrey.schweikert.ch/",
     "transient"),
    (421, "4.7.0 Try again later, closing connection. (EHLO) a1si123 - gsmtp", "transient"),  # Gmail
    # uncategorized
    (554, "5.3.0 message data unreadable in queue: bad checksum", "uncategorized"),
    (500, "5.5.1 Command unrecognized", "uncategorized"),
]


@pytest.mark.parametrize(("code", "message", "expected"), REPLIES, ids=[f"{i}-{r[2]}" for i, r in enumerate(REPLIES)])
def test_shipped_rules_classify_real_world_replies(code, message, expected):
    """Each reply, split as delivery splits it (code, enhanced code, text), gets the category a mail
    administrator would give it."""
    reply = split_enhanced(code, message)
    assert expected == classify(default_rules(), reply.code, reply.enhanced, reply.text)


def test_the_table_covers_every_category():
    """The real-world table exercises every category the classifier can give, with at least 30 replies."""
    assert set(CATEGORIES) == {r[2] for r in REPLIES}
    assert len(REPLIES) >= 30


def test_classify_never_raises_on_odd_input():
    """A reply code that is not three digits, an enhanced code that does not parse, a huge text: a category,
    no exception."""
    rules = default_rules()
    assert "uncategorized" == classify(rules, 0, "", "")
    assert "uncategorized" == classify(rules, "abc", "5.x.y", "x" * 1_000_000)
    assert "transient" == classify(rules, 451, "garbage", "")


CUSTOM = """
version = 1
[[rules]]
category = "rate_limited"
text = ['(?i)likely unsolicited mail']
"""


def test_custom_rules_come_before_the_shipped_ones():
    """A custom file's rule overrides the shipped category for the replies it matches; other replies keep
    theirs (the shipped rules still follow, as KumoMTA tries the first file loaded first)."""
    text = "[192.0.2.1] Our system has detected that this message is likely unsolicited mail."
    assert "content_related" == classify(default_rules(), 550, "5.7.1", text)
    rules = combine(CUSTOM, "custom.toml")
    assert "rate_limited" == classify(rules, 550, "5.7.1", text)
    assert "invalid_recipient" == classify(rules, 550, "5.1.1", "no such user")


def test_include_defaults_false_uses_only_the_custom_rules():
    """``include_defaults = false``: a reply the custom file does not match is uncategorized."""
    rules = combine(CUSTOM.replace("version = 1", "version = 1\ninclude_defaults = false"), "custom.toml")
    assert "uncategorized" == classify(rules, 550, "5.1.1", "no such user")


def test_code_enhanced_and_stage_conditions_all_must_match():
    """A rule's conditions are and-ed; 'x' and 'X' are wildcards; a stage rule never matches an unknown stage."""
    rules, _ = parse_rules("""
version = 1
[[rules]]
category = "policy_related"
code = ["55x"]
enhanced = ["X.7.1"]
stage = ["rcpt"]
""")
    assert "policy_related" == classify(rules, 554, "5.7.1", "", "rcpt")
    assert "uncategorized" == classify(rules, 554, "5.7.1", "", "data")
    assert "uncategorized" == classify(rules, 554, "5.7.1", "")
    assert "uncategorized" == classify(rules, 450, "4.7.1", "", "rcpt")


@pytest.mark.parametrize(("text", "expected"), [
    ("version = 1\n[[rules]]\ncategory = \"nope\"\ntext = ['x']\n",
     "f.toml: rule 1: category: 'nope' is not one of invalid_recipient, "),
    ("version = 1\n[[rules]]\ncategory = \"transient\"\ntext = ['(']\n", "f.toml: rule 1: text[0]: bad regular expression '(': "),
    ("version = 1\n[[rules]]\ncategory = \"transient\"\nenhanced = ['5.1']\n",
     "f.toml: rule 1: enhanced[0]: '5.1' is not an RFC 3463 code like 5.1.1 or X.7.26"),
    ("version = 1\n[[rules]]\ncategory = \"transient\"\ncode = ['6xx']\n",
     "f.toml: rule 1: code[0]: '6xx' is not a reply code like 550 or 5xx"),
    ("version = 1\n[[rules]]\ncategory = \"transient\"\n", "f.toml: rule 1: no condition (give code, enhanced, text or stage)"),
    ("version = 1\n[[rules]]\ncategory = \"transient\"\ntexts = ['a']\n", "f.toml: rule 1: unknown key 'texts' "),
    ("[[rules]]\ncategory = \"transient\"\ntext = ['a']\n", "f.toml: version: expected 1, got None"),
    ("version = 1\nrules = [", "f.toml: "),
])
def test_a_bad_rule_file_is_one_line_naming_file_rule_and_key(text, expected):
    """Every problem of a rule file is a RuleError whose message is one line starting with the file, the rule
    (1-based) and the key."""
    with pytest.raises(RuleError) as info:
        parse_rules(text, "f.toml")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(expected), msg


def test_a_config_names_its_rule_file_and_a_missing_one_is_one_line(tmp_path):
    """``bounce_classification_file`` of a loaded config: its rules first (mtaq.delivery.classify.load_rules);
    a file that is not there is a ConfigError naming the key and the file."""
    from mtaq.config import load_config
    from mtaq.core.errors import ConfigError
    from mtaq.delivery.classify import load_rules

    path = tmp_path / "bounces.toml"
    path.write_text(CUSTOM)
    rules = load_rules(load_config(None, {"bounce_classification_file": str(path)}))
    assert "rate_limited" == classify(rules, 550, "5.7.1", "this message is likely unsolicited mail")
    assert "content_related" == classify(load_rules(load_config(None, {})), 550, "5.7.1",
                                         "this message is likely unsolicited mail")
    with pytest.raises(ConfigError) as info:
        load_rules(load_config(None, {"bounce_classification_file": str(tmp_path / "nope.toml")}))
    assert f"bounce_classification_file: {tmp_path / 'nope.toml'}: No such file or directory" == str(info.value)
