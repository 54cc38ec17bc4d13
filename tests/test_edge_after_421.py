"""After a 421 nothing more is read (found by review): a DATA pipelined behind the commands that led to a
421 'too many errors' was still queued, and the client, told 421, would send it again (a duplicate).
The real edge over a real socket."""

from __future__ import annotations

from edgekit import run_edge

from mtaq.edge.policy import EdgePolicy


def test_a_data_pipelined_after_421_is_not_queued(tmp_path):
    with run_edge(tmp_path, EdgePolicy(errors_max=3)) as edge:
        with edge.raw() as c:
            assert c.reply().startswith("220")
            assert c.command("EHLO client.test").startswith("250")
            c.send(b"MAIL FROM:<a@client.test>\r\nRCPT TO:<ok@example.org>\r\n" + b"BOGUS\r\n" * 3
                   + b"DATA\r\nSubject: smuggled\r\n\r\nafter the 421\r\n.\r\n"
                   + b"MAIL FROM:<b@client.test>\r\nRCPT TO:<ok@example.org>\r\nDATA\r\nSubject: 2\r\n\r\nx\r\n.\r\n")
            replies = []
            while r := c.reply():
                replies.append(r)
        assert replies[-1].startswith("421 4.7.0") and "too many errors" in replies[-1], replies
        assert not any(r.startswith("354") for r in replies), replies
        # A sync point instead of a sleep: a message sent afterwards on a new connection is appended after
        # anything the first session appended, and the group commit makes a prefix durable in order.
        with edge.raw() as c:
            assert c.reply().startswith("220")
            assert c.command("EHLO client.test").startswith("250")
            assert c.command("MAIL FROM:<c@client.test>").startswith("250")
            assert c.command("RCPT TO:<ok@example.org>").startswith("250")
            assert c.command("DATA").startswith("354")
            assert c.command("Subject: after\r\n\r\nlater\r\n.").startswith("250")
        assert ["c@client.test"] == [env.sender for env in edge.durable]
