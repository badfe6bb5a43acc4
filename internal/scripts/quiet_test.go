package scripts_test

// Tests of RunLoneQuietRelease: the release of a last count as HDEL and PUBLISH,
// which must leave the lock and answer as lock_release does.

import (
	"cmp"
	"fmt"
	"strconv"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// quietKeys and quietArgs are lock_release's keys and arguments as the engine
// sends them for a last-count release of owner: no count kept, no registration
// dropped.
func quietKeys(key string) []string {
	return []string{key, channel(key), "leash_lock_reg:{" + key + "}", "leash_lock_regq:{" + key + "}"}
}

func quietArgs(owner string) []string {
	return []string{unlockMsg, strconv.Itoa(lease), owner, "client-q", "0", "0"}
}

// quietCases are last-count releases by c:1 and what lock_release answers and
// leaves.
var quietCases = []struct {
	name     string
	hash     string
	listen   bool // another connection subscribes to the unlock channel
	want     string
	wantHash string
}{
	{name: "held, nobody listens", hash: "c:1=1", want: "2"},
	{name: "held, a listener", hash: "c:1=1", listen: true, want: "1"},
	{name: "free", want: "nil"},
	{name: "another owner's", hash: "c:2=1", want: "nil", wantHash: "c:2=1"},
}

// TestRunLoneQuietRelease runs the same releases through the script and through
// RunLoneQuietRelease, on the same lock states: the replies and what is left in
// Redis are the same, and the quiet one runs no script. Only the unlock message
// differs: the pair publishes it whatever HDEL found (where nobody holds the
// field, a spurious but harmless wake-up; where nobody listens, to nobody).
func TestRunLoneQuietRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range quietCases {
		t.Run(tc.name, func(t *testing.T) {
			for _, quiet := range []bool{false, true} {
				key := fmt.Sprintf("quiet%d-%t", i, quiet)
				e.setHash(t, key, tc.hash, 1_000)
				if tc.listen {
					e.subscribe(t, channel(key))
				}
				// A pattern subscriber counts for PUBLISH's reply (not for the
				// script's PUBSUB NUMSUB): where nobody may listen, nobody watches.
				var w *watcher
				if tc.want != "2" {
					w = e.watch(t, key)
				}
				before := e.commandCounts(t)
				var rep scripts.Reply
				var err error
				if quiet {
					rep, err = e.r.RunLoneQuietRelease(ctxT(t), scripts.LockRelease, quietKeys(key), quietArgs("c:1"))
				} else {
					rep, err = e.r.RunLone(ctxT(t), scripts.LockRelease, quietKeys(key), quietArgs("c:1"))
				}
				if err != nil {
					t.Fatalf("quiet=%t: %v", quiet, err)
				}
				scripted := scriptCalls(e.commandCounts(t)) - scriptCalls(before)
				wantReply(t, fmt.Sprintf("quiet=%t", quiet), rep, tc.want)
				e.wantHash(t, key, tc.wantHash)
				if quiet && scripted != 0 {
					t.Errorf("the quiet release ran %d script calls", scripted)
				}
				// The script publishes when it released to a listener; the pair
				// always publishes (the watcher's pattern does not count as one).
				if w != nil {
					w.wantUnlock(t, key, quiet || tc.want == "1")
				}
			}
		})
	}
}

// TestRunLoneQuietReleaseFallsBack: a release that keeps a count, or drops the
// caller's registration, is the script's alone.
func TestRunLoneQuietReleaseFallsBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range []struct {
		name     string
		hash     string
		args     []string
		want     string
		wantHash string
	}{
		{name: "keeping a count", hash: "c:1=2", args: append(quietArgs("c:1"), "1"), want: "0", wantHash: "c:1=1"},
		{name: "dropping a registration", hash: "c:1=1",
			args: []string{unlockMsg, strconv.Itoa(lease), "c:1", "client-q", "0", "1"}, want: "2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("quiet-fb%d", i)
			e.setHash(t, key, tc.hash, 1_000)
			before := e.commandCounts(t)
			rep, err := e.r.RunLoneQuietRelease(ctxT(t), scripts.LockRelease, quietKeys(key), tc.args)
			if err != nil {
				t.Fatal(err)
			}
			wantReply(t, "fallback", rep, tc.want)
			e.wantHash(t, key, tc.wantHash)
			if n := scriptCalls(e.commandCounts(t)) - scriptCalls(before); n != 1 {
				t.Errorf("%d script calls, want the script's 1", n)
			}
		})
	}
}

// TestRunLoneQuietReleaseWrongType: a key that is not a hash fails as the
// script's HGET does, and is left alone.
func TestRunLoneQuietReleaseWrongType(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.do(t, "SET", "quiet-str", "x")
	_, err := e.r.RunLoneQuietRelease(ctxT(t), scripts.LockRelease, quietKeys("quiet-str"), quietArgs("c:1"))
	if err == nil {
		t.Fatal("released a string key")
	}
	if got := e.do(t, "GET", "quiet-str"); got != "x" {
		t.Errorf("the key holds %q, want x", got)
	}
}

// TestRunLoneQuietFairRelease runs fair_release's last-count cases through the
// script and through RunLoneQuietRelease: the same reply, lock, queue, grants
// and messages. With nobody queued the quiet one runs no script; with a queue it
// runs the script after HDEL, which passes the lock on.
func TestRunLoneQuietFairRelease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cases := []struct {
		fairCase
		quietWant string // the quiet reply where it differs from the script's
		scripted  int64  // script calls the quiet release runs
	}{
		{fairCase: fairCase{name: "empty queue", hash: "A=1", owner: "A", want: "2"}},
		{fairCase: fairCase{name: "the head is woken", hash: "A=1", queue: "B:+25000 C:+30000", owner: "A",
			want: "1", wantQueue: "B:+25000 C:+30000", wantWake: []string{"B"}}, scripted: 1},
		{fairCase: fairCase{name: "a registered head gets the lock", hash: "A=1", queue: "B:+25000 C:+30000",
			grants: "B=45000:7 C=45000:8", owner: "A", want: "1", wantHash: "B=1", wantLease: leaseB,
			wantQueue: "C:+5000", wantGrants: "C=45000:8", wantWake: []string{"B=leash:grant:7"}}, scripted: 1},
		// The pair cannot tell a stale head from a live one: the script purges
		// it, and the reply says somebody was queued.
		{fairCase: fairCase{name: "only stale heads", hash: "A=1", queue: "B:+500 C:+1000", owner: "A", at: 1_000,
			want: "2"}, quietWant: "1", scripted: 1},
		{fairCase: fairCase{name: "not held, lock free: the head is still woken", queue: "B:+25000", owner: "A",
			want: "nil", wantQueue: "B:+25000", wantWake: []string{"B"}}, scripted: 1},
		{fairCase: fairCase{name: "not held, empty queue", owner: "A", want: "nil"}},
		{fairCase: fairCase{name: "another owner's", hash: "X=1", owner: "A", want: "nil", wantHash: "X=1"}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, quiet := range []bool{false, true} {
				f := fairLock(fmt.Sprintf("qfr%d-%t", i, quiet))
				w := tc.setup(t, e, f)
				args := []string{unlockMsg, strconv.Itoa(lease), tc.owner, at(tc.at), strconv.Itoa(wait)}
				before := e.commandCounts(t)
				var rep scripts.Reply
				var err error
				c := tc.fairCase
				if quiet {
					rep, err = e.r.RunLoneQuietRelease(ctxT(t), scripts.FairRelease, f.keys(), args)
					c.want = cmp.Or(tc.quietWant, tc.want)
				} else {
					rep, err = e.r.RunLone(ctxT(t), scripts.FairRelease, f.keys(), args)
				}
				if err != nil {
					t.Fatalf("quiet=%t: %v", quiet, err)
				}
				c.check(t, e, f, w, fmt.Sprintf("quiet=%t", quiet), rep)
				if n := scriptCalls(e.commandCounts(t)) - scriptCalls(before); quiet && n != tc.scripted {
					t.Errorf("the quiet release ran %d script calls, want %d", n, tc.scripted)
				}
			}
		})
	}
}
