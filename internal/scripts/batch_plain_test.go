package scripts_test

// Tests of RunBatch's plain commands: a fresh LockAcquire as RESTORE and a quiet
// LockRelease as HDEL and PUBLISH, among merged script calls, answering as the
// scripts do and running in the batch's order.

import (
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// fillers are script calls around the call under test, so that it sits inside
// a batch of merged calls: acquires of locks of their own, by c:9.
func fillers(prefix string, n int) []scripts.Call {
	calls := make([]scripts.Call, n)
	for i := range calls {
		calls[i] = scripts.Call{ID: scripts.LockAcquire, Keys: []string{fmt.Sprintf("%s-fill%d", prefix, i)}, Args: []string{strconv.Itoa(lease), "c:9"}}
	}
	return calls
}

// batch runs fillers, the calls under test, and fillers again, checks the
// fillers took their locks, and returns the calls' results.
func (e *env) batch(t *testing.T, r *scripts.Redis, prefix string, calls ...scripts.Call) []scripts.Result {
	t.Helper()
	all := append(append(fillers(prefix+"a", 3), calls...), fillers(prefix+"b", 2)...)
	out := r.RunBatch(ctxT(t), all, nil)
	if len(out) != len(all) {
		t.Fatalf("%d results for %d calls", len(out), len(all))
	}
	for i, res := range out {
		if i >= 3 && i < 3+len(calls) {
			continue
		}
		if res.Err != nil || !res.Reply.Nil {
			t.Fatalf("filler %d: %+v", i, res)
		}
	}
	return out[3 : 3+len(calls)]
}

func freshCall(key, owner string) scripts.Call {
	return scripts.Call{ID: scripts.LockAcquire, Keys: []string{key}, Args: []string{strconv.Itoa(lease), owner}, Fresh: true}
}

func quietCall(key, owner string) scripts.Call {
	return scripts.Call{ID: scripts.LockRelease, Keys: quietKeys(key), Args: quietArgs(owner), Quiet: true}
}

// resend is what the engine does with a refused fresh acquire: the same call as
// the script, in a batch of its own.
func (e *env) resend(t *testing.T, r *scripts.Redis, call scripts.Call) scripts.Reply {
	t.Helper()
	call.Fresh = false
	res := r.RunBatch(ctxT(t), []scripts.Call{call}, nil)[0]
	if res.Err != nil {
		t.Fatalf("resent %q: %v", call.Keys, res.Err)
	}
	return res.Reply
}

// TestRunBatchFresh runs lock_acquire's cases as a batch's fresh call: a free
// lock costs one RESTORE and no script call of its own, and answers as the
// script; a lock that is not free a refused RESTORE, which changes nothing and
// answers ErrFreshRefused, and then the script (as the engine sends it)
// answers and leaves the lock as it does.
func TestRunBatchFresh(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range acquireCases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("bfresh%d", i)
			e.setHash(t, key, tc.hash, tc.pttl)
			before := e.commandCounts(t)
			call := freshCall(key, tc.owner)
			res := e.batch(t, e.r, key, call)[0]
			after := e.commandCounts(t)
			restores := after["restore"].calls - before["restore"].calls
			busy := after["restore"].failed - before["restore"].failed
			// The fillers are two merged calls, before and after the RESTORE.
			if scripted := scriptCalls(after) - scriptCalls(before); restores != 1 || scripted != 2 {
				t.Errorf("%d RESTOREs, %d script calls; want 1 and the fillers' 2", restores, scripted)
			}
			if tc.hash == "" {
				if res.Err != nil || busy != 0 {
					t.Fatalf("free lock: %v, %d RESTOREs refused", res.Err, busy)
				}
				tc.check(t, e, key, res.Reply)
				return
			}
			if !errors.Is(res.Err, scripts.ErrFreshRefused) || busy != 1 {
				t.Fatalf("lock not free: %v, %d RESTOREs refused; want ErrFreshRefused and 1", res.Err, busy)
			}
			e.wantHash(t, key, tc.hash) // nothing ran
			tc.check(t, e, key, e.resend(t, e.r, call))
		})
	}
}

// TestRunBatchQuiet runs last-count releases as a batch's quiet call: the
// script's replies and hashes, with no script call of its own.
func TestRunBatchQuiet(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for i, tc := range quietCases {
		t.Run(tc.name, func(t *testing.T) {
			key := fmt.Sprintf("bquiet%d", i)
			e.setHash(t, key, tc.hash, 1_000)
			if tc.listen {
				e.subscribe(t, channel(key))
			}
			before := e.commandCounts(t)
			res := e.batch(t, e.r, key, quietCall(key, "c:1"))[0]
			after := e.commandCounts(t)
			if res.Err != nil {
				t.Fatal(res.Err)
			}
			wantReply(t, "quiet release", res.Reply, tc.want)
			e.wantHash(t, key, tc.wantHash)
			if n := scriptCalls(after) - scriptCalls(before); n != 2 {
				t.Errorf("%d script calls, want the fillers' 2", n)
			}
			if n := after["hdel"].calls - before["hdel"].calls; n != 1 {
				t.Errorf("%d HDELs, want 1", n)
			}
		})
	}
}

// TestRunBatchPlainOrder: plain commands run in their calls' places. A release
// before another owner's fresh acquire of the same lock frees it for that
// acquire; an acquire before the release meets the lock held (BUSYKEY), and its
// script, sent after, finds it free.
func TestRunBatchPlainOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.setHash(t, "border1", "c:1=1", 10_000)
	res := e.batch(t, e.r, "border1", quietCall("border1", "c:1"), freshCall("border1", "c:2"))
	wantReply(t, "release", res[0].Reply, "2")
	wantReply(t, "acquire after it", res[1].Reply, "nil")
	if !res[1].Reply.SentAt.IsZero() {
		t.Error("the acquire after the release was re-sent")
	}
	e.wantHash(t, "border1", "c:2=1")

	e.setHash(t, "border2", "c:1=1", 10_000)
	res = e.batch(t, e.r, "border2", freshCall("border2", "c:2"), quietCall("border2", "c:1"))
	if !errors.Is(res[0].Err, scripts.ErrFreshRefused) {
		t.Fatalf("acquire before the release: %v, want ErrFreshRefused", res[0].Err)
	}
	wantReply(t, "release", res[1].Reply, "2")
	e.wantHash(t, "border2", "")
	wantReply(t, "the acquire's script", e.resend(t, e.r, freshCall("border2", "c:2")), "nil")
	e.wantHash(t, "border2", "c:2=1")
	e.wantPTTL(t, "border2", lease)
}

// TestRunBatchPlainShapes: calls flagged Fresh or Quiet that the plain commands
// cannot stand for go as their scripts: an acquire that registers its owner, a
// release that keeps a count, and the flags on other scripts.
func TestRunBatchPlainShapes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.setHash(t, "bshape-count", "c:1=2", 10_000)
	e.setHash(t, "bshape-renew", "c:1=1", 10_000)
	calls := []scripts.Call{
		{ID: scripts.LockRelease, Keys: quietKeys("bshape-count"), Args: append(quietArgs("c:1"), "1"), Quiet: true},
		{ID: scripts.LockRenew, Keys: []string{"bshape-renew"}, Args: []string{strconv.Itoa(lease), "c:1"}, Fresh: true, Quiet: true},
	}
	before := e.commandCounts(t)
	res := e.batch(t, e.r, "bshape", calls...)
	after := e.commandCounts(t)
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("call %d: %v", i, r.Err)
		}
	}
	wantReply(t, "release keeping a count", res[0].Reply, "0")
	e.wantHash(t, "bshape-count", "c:1=1")
	if n := after["hdel"].calls + after["restore"].calls - before["hdel"].calls - before["restore"].calls; n != 0 {
		t.Errorf("%d plain HDEL or RESTORE commands, want none", n)
	}
}

// TestRunBatchPlainRefused: an ACL user that may not RESTORE, nor PUBLISH,
// takes and releases locks in batches all the same; after the first refusal of
// each, this runner sends the scripts.
func TestRunBatchPlainRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.aclRunner(t, "noplain", "~*", "resetchannels", "+@all", "-restore")
	for i := range 3 {
		key := fmt.Sprintf("bnoplain%d", i)
		res := e.batch(t, r, key, freshCall(key, "c:1"))[0]
		switch {
		case i == 0 && errors.Is(res.Err, scripts.ErrFreshRefused):
			e.wantHash(t, key, "")
			res.Reply, res.Err = e.resend(t, r, freshCall(key, "c:1")), nil
		case res.Err != nil:
			t.Fatalf("acquire %d: %v", i, res.Err)
		}
		wantReply(t, "acquire", res.Reply, "nil")
		e.wantHash(t, key, "c:1=1")
		res = e.batch(t, r, key+"r", quietCall(key, "c:1"))[0]
		if res.Err != nil {
			t.Fatalf("release %d: %v", i, res.Err)
		}
		wantReply(t, "release", res.Reply, "2")
		e.wantHash(t, key, "")
	}
	c := e.commandCounts(t)
	if got := c["restore"].rejected; got != 1 {
		t.Errorf("%d RESTOREs refused, want 1 (none after the first refusal)", got)
	}
	if got := c["publish"].rejected; got != 1 {
		t.Errorf("%d PUBLISHes refused, want 1 (none after the first refusal)", got)
	}
}

// TestRunBatchPlainAfterScriptFlush: with the script cache flushed, a batch's
// merged calls meet NOSCRIPT and go again after the scripts are loaded, while
// its plain commands, which ran, answer at once; every call ends as it should.
func TestRunBatchPlainAfterScriptFlush(t *testing.T) {
	t.Parallel()
	e := newEnv(t) // a server of its own, whose script cache it flushes
	e.setHash(t, "bflush-rel", "c:1=1", 10_000)
	e.do(t, "SCRIPT", "FLUSH")
	calls := []scripts.Call{
		{ID: scripts.LockAcquire, Keys: []string{"bflush-acq"}, Args: []string{strconv.Itoa(lease), "c:1"}},
		quietCall("bflush-rel", "c:1"),
		freshCall("bflush-fresh", "c:1"),
		{ID: scripts.LockAcquire, Keys: []string{"bflush-acq2"}, Args: []string{strconv.Itoa(lease), "c:1"}},
	}
	out := e.r.RunBatch(ctxT(t), calls, nil)
	for i, want := range []string{"nil", "2", "nil", "nil"} {
		if out[i].Err != nil {
			t.Fatalf("call %d: %v", i, out[i].Err)
		}
		wantReply(t, fmt.Sprintf("call %d", i), out[i].Reply, want)
	}
	for key, want := range map[string]string{"bflush-acq": "c:1=1", "bflush-rel": "", "bflush-fresh": "c:1=1", "bflush-acq2": "c:1=1"} {
		e.wantHash(t, key, want)
	}
	if !out[1].Reply.SentAt.IsZero() || !out[2].Reply.SentAt.IsZero() {
		t.Error("a plain command's reply is dated as sent again")
	}
	if out[0].Reply.SentAt.IsZero() {
		t.Error("the merged call sent again after NOSCRIPT is not dated at its second send")
	}
}
