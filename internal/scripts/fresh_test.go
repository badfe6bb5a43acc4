package scripts_test

// Tests of RunLoneFresh: the acquire of a lock expected to be free, as one RESTORE
// of a lock hash, with the acquire script behind it.

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/leash-go/leash/internal/scripts"
)

// commandCount is one command's counters from INFO commandstats.
type commandCount struct{ calls, rejected, failed int64 }

// commandCounts reads INFO commandstats: cmdstat_<name> → its counters.
func (e *env) commandCounts(t *testing.T) map[string]commandCount {
	t.Helper()
	out := make(map[string]commandCount)
	for line := range strings.SplitSeq(e.do(t, "INFO", "commandstats"), "\n") {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		var c commandCount
		for kv := range strings.SplitSeq(stats, ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				c.calls = n
			case "rejected_calls":
				c.rejected = n
			case "failed_calls":
				c.failed = n
			}
		}
		out[strings.TrimPrefix(name, "cmdstat_")] = c
	}
	return out
}

// scriptCalls is how many script calls the counts show ran (EVALSHA and EVAL; an
// EVALSHA refused with NOSCRIPT, which RunLone follows with EVAL, is not one).
func scriptCalls(c map[string]commandCount) int64 {
	n := int64(0)
	for _, cmd := range []string{"evalsha", "eval"} {
		n += c[cmd].calls - c[cmd].failed - c[cmd].rejected
	}
	return n
}

func (e *env) fresh(t *testing.T, r *scripts.Redis, key, owner string) scripts.Reply {
	t.Helper()
	rep, err := r.RunLoneFresh(ctxT(t), []string{key}, []string{strconv.Itoa(lease), owner})
	if err != nil {
		t.Fatalf("RunLoneFresh %s %s: %v", key, owner, err)
	}
	return rep
}

// TestRunLoneFresh runs lock_acquire's cases through RunLoneFresh: every reply
// and hash is the script's, a free lock costs one RESTORE and no script call,
// and a lock that is not free one refused RESTORE and the script.
func TestRunLoneFresh(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range acquireCases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("fresh%d", i)
			e.setHash(t, key, tc.hash, tc.pttl)
			before := e.commandCounts(t)
			rep := e.fresh(t, e.r, key, tc.owner)
			after := e.commandCounts(t)
			tc.check(t, e, key, rep)
			restores := after["restore"].calls - before["restore"].calls
			busy := after["restore"].failed - before["restore"].failed
			scripted := scriptCalls(after) - scriptCalls(before)
			wantBusy, wantScripted := int64(1), int64(1)
			if tc.hash == "" {
				wantBusy, wantScripted = 0, 0
			}
			if restores != 1 || busy != wantBusy || scripted != wantScripted {
				t.Errorf("%d RESTOREs (%d refused), %d script calls; want 1 (%d refused), %d", restores, busy, scripted, wantBusy, wantScripted)
			}
			// A reply of the script after a refused RESTORE is dated at the
			// script's send (Reply.SentAt); RESTORE's own reply is not re-dated.
			if got := !rep.SentAt.IsZero(); got != (wantScripted == 1) {
				t.Errorf("reply SentAt %v, want set only when the script answered", rep.SentAt)
			}
		})
	}
	t.Run("then the release script", func(t *testing.T) {
		wantReply(t, "RunLoneFresh", e.fresh(t, e.r, "fresh-rel", "c:1"), "nil")
		wantReply(t, "lock_release", e.run(t, scripts.LockRelease, []string{"fresh-rel", channel("fresh-rel")}, unlockMsg, strconv.Itoa(lease), "c:1"), "1")
		e.wantHash(t, "fresh-rel", "")
	})
	t.Run("then a re-entry and two releases", func(t *testing.T) {
		wantReply(t, "RunLoneFresh", e.fresh(t, e.r, "fresh-re", "c:1"), "nil")
		wantReply(t, "lock_acquire", e.run(t, scripts.LockAcquire, []string{"fresh-re"}, strconv.Itoa(lease), "c:1"), "nil")
		e.wantHash(t, "fresh-re", "c:1=2")
		wantReply(t, "lock_release", e.run(t, scripts.LockRelease, []string{"fresh-re", channel("fresh-re")}, unlockMsg, strconv.Itoa(lease), "c:1"), "0")
		e.wantHash(t, "fresh-re", "c:1=1")
		wantReply(t, "lock_release", e.run(t, scripts.LockRelease, []string{"fresh-re", channel("fresh-re")}, unlockMsg, strconv.Itoa(lease), "c:1"), "1")
		e.wantHash(t, "fresh-re", "")
	})
	// Field lengths at the edges of the RDB length encodings (6 bits, 14 bits,
	// 32 bits).
	for _, n := range []int{1, 63, 64, 16383, 16384, 70000} {
		t.Run(fmt.Sprintf("field of %d bytes", n), func(t *testing.T) {
			key := fmt.Sprintf("fresh-len%d", n)
			field := strings.Repeat("f", n)
			before := e.commandCounts(t)
			wantReply(t, "RunLoneFresh", e.fresh(t, e.r, key, field), "nil")
			if d := scriptCalls(e.commandCounts(t)) - scriptCalls(before); d != 0 {
				t.Errorf("%d script calls, want none: RESTORE did not take the lock", d)
			}
			if got := e.do(t, "HGET", key, field); got != "1" {
				t.Errorf("HGET %s <field> = %q, want 1", key, got)
			}
			if got := e.doInt(t, "HLEN", key); got != 1 {
				t.Errorf("HLEN %s = %d, want 1", key, got)
			}
			e.wantPTTL(t, key, lease)
		})
	}
	t.Run("with deep sanitization of DUMP payloads", func(t *testing.T) {
		e.do(t, "CONFIG", "SET", "sanitize-dump-payload", "yes")
		defer e.do(t, "CONFIG", "SET", "sanitize-dump-payload", "no")
		before := e.commandCounts(t)
		wantReply(t, "RunLoneFresh", e.fresh(t, e.r, "fresh-sane", "c:1"), "nil")
		if d := scriptCalls(e.commandCounts(t)) - scriptCalls(before); d != 0 {
			t.Errorf("%d script calls, want none: RESTORE did not take the lock", d)
		}
		e.wantHash(t, "fresh-sane", "c:1=1")
	})
	t.Run("a lease the script refuses", func(t *testing.T) {
		// RunLoneFresh leaves a lease that is no positive integer to the script,
		// and so fails, and leaves the key, as the script does.
		_, errScript := e.r.Run(ctxT(t), scripts.LockAcquire, []string{"script-bad"}, []string{"soon", "c:1"})
		_, errFresh := e.r.RunLoneFresh(ctxT(t), []string{"fresh-bad"}, []string{"soon", "c:1"})
		if _, ok := rueidis.IsRedisErr(errFresh); !ok || errScript == nil {
			t.Errorf("lease \"soon\": RunLoneFresh's error %v, the script's %v; want Redis error replies", errFresh, errScript)
		}
		if got, want := e.hash(t, "fresh-bad"), e.hash(t, "script-bad"); got != want {
			t.Errorf("lease \"soon\": RunLoneFresh left %q, the script %q", got, want)
		}
	})
}

// TestRunLoneFreshWithoutRestore: a user whose ACL denies RESTORE takes locks
// through the script, and its runner stops sending RESTORE after the first
// refusal.
func TestRunLoneFreshWithoutRestore(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.aclRunner(t, "norestore", "~*", "&*", "+@all", "-restore")
	for i := range 3 {
		key := fmt.Sprintf("norestore%d", i)
		wantReply(t, "RunLoneFresh", e.fresh(t, r, key, "c:1"), "nil")
		e.wantHash(t, key, "c:1=1")
		e.wantPTTL(t, key, lease)
	}
	c := e.commandCounts(t)
	if got := c["restore"].rejected; got != 1 {
		t.Errorf("%d RESTOREs refused, want 1 (none after the first refusal)", got)
	}
	if got := scriptCalls(c); got < 3 {
		t.Errorf("%d script calls, want at least 3", got)
	}
}

// TestLockDumpCRC checks Redis's CRC-64 against its check value: crc64.c's own
// test, crc64(0, "123456789") = 0xe9c6d914c4b8d9ca.
func TestLockDumpCRC(t *testing.T) {
	if got := scripts.RedisCRC64([]byte("123456789")); got != 0xe9c6d914c4b8d9ca {
		t.Errorf("crc64(123456789) = %#x, want 0xe9c6d914c4b8d9ca", got)
	}
}

// TestRestoreRefusals classifies RESTORE's error replies: the key exists (today's
// BUSYKEY and Redis 2.8's text), or a refusal any write can meet for a while,
// which must not turn RESTORE off for good.
func TestRestoreRefusals(t *testing.T) {
	for _, tc := range []struct {
		msg             string
		busy, transient bool
	}{
		{"BUSYKEY Target key name already exists.", true, false},
		{"ERR Target key name is busy.", true, false},
		{"BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", false, true},
		{"LOADING Redis is loading the dataset in memory", false, true},
		{"READONLY You can't write against a read only replica.", false, true},
		{"OOM command not allowed when used memory > 'maxmemory'.", false, true},
		{"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", false, true},
		{"NOPERM User norestore has no permissions to run the 'restore' command", false, false},
		{"ERR unknown command 'RESTORE', with args beginning with: ", false, false},
		{"ERR DUMP payload version or checksum are wrong", false, false},
	} {
		if got := scripts.BusyKey(tc.msg); got != tc.busy {
			t.Errorf("busyKey(%q) = %v, want %v", tc.msg, got, tc.busy)
		}
		if got := scripts.TransientRefusal(tc.msg); got != tc.transient {
			t.Errorf("transientRefusal(%q) = %v, want %v", tc.msg, got, tc.transient)
		}
	}
}

// TestReplySentAt: a reply answered by a command sent after the call began (an
// EVAL after NOSCRIPT, a batch's unit sent again) carries that send time; one
// answered by the first command sent carries none.
func TestReplySentAt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	acquire := func(key string) scripts.Call {
		return scripts.Call{ID: scripts.LockAcquire, Keys: []string{key}, Args: []string{strconv.Itoa(lease), "c:1"}}
	}
	check := func(what string, began time.Time, rep scripts.Reply, err error, resent bool) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := !rep.SentAt.IsZero(); got != resent || (resent && rep.SentAt.Before(began)) {
			t.Errorf("%s: SentAt %v (call began %v), want it set: %v", what, rep.SentAt, began, resent)
		}
	}
	for _, lane := range []struct {
		name string
		run  func(c scripts.Call) (scripts.Reply, error)
	}{
		{"Run", func(c scripts.Call) (scripts.Reply, error) { return e.r.Run(ctxT(t), c.ID, c.Keys, c.Args) }},
		{"RunLone", func(c scripts.Call) (scripts.Reply, error) { return e.r.RunLone(ctxT(t), c.ID, c.Keys, c.Args) }},
		{"RunBatch", func(c scripts.Call) (scripts.Reply, error) {
			res := e.r.RunBatch(ctxT(t), []scripts.Call{c}, nil)
			return res[0].Reply, res[0].Err
		}},
	} {
		e.do(t, "SCRIPT", "FLUSH")
		began := time.Now()
		rep, err := lane.run(acquire("sent-" + lane.name))
		check(lane.name+" after SCRIPT FLUSH", began, rep, err, true)
		began = time.Now()
		rep, err = lane.run(acquire("sent-" + lane.name))
		check(lane.name+" with the script loaded", began, rep, err, false)
	}
}
