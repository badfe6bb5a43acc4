package scripts_test

// Tests of RunLoneFreshFair: a fair lock's first attempt as RESTORE and LINDEX,
// with the scripts behind them.

import (
	"fmt"
	"slices"
	"strconv"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

func (e *env) freshFair(t *testing.T, f fair, c fairCase) scripts.Reply {
	t.Helper()
	rep, err := e.r.RunLoneFreshFair(ctxT(t), f.acquireKeys(), c.acquireArgs(), f.prefix)
	if err != nil {
		t.Fatalf("RunLoneFreshFair: %v", err)
	}
	return rep
}

// TestRunLoneFreshFair runs fair_acquire's cases (but the join-only ones, which
// never come here) through RunLoneFreshFair: the reply, lock, queue and grants
// are the script's. Where the lock was free but somebody else headed the queue,
// the RESTORE took it past the queue for a moment, and its give-back
// (fair_release) passed the lock on to the head, which is also woken. A free
// lock with nobody queued costs one RESTORE and no script; a held one a refused
// RESTORE and the script.
func TestRunLoneFreshFair(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// The heads the give-back wakes, by case.
	wakes := map[string][]string{
		"free lock with a live head: queue behind it":     {"X"},
		"free lock, second asks again behind a live head": {"B"},
		"stale head purged, next acquires":                {"C"},
		"head one ms before its deadline is not purged":   {"B"},
		"stale heads purged in a row":                     {"D"},
		"head without a deadline counts as stale":         {"C"},
		"single try, free lock with a live head":          {"X"},
		"a purged head loses its registration":            {"C"},
	}
	for i, tc := range fairAcquireCases {
		if tc.joinOnly {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			f := fairLock(fmt.Sprintf("ff%d", i))
			w := tc.setup(t, e, f)
			before := e.commandCounts(t)
			rep := e.freshFair(t, f, tc)
			after := e.commandCounts(t)
			c := tc
			c.wantWake = append(slices.Clone(wakes[tc.name]), tc.wantWake...)
			c.check(t, e, f, w, "RunLoneFreshFair", rep)
			restores := after["restore"].calls - before["restore"].calls
			busy := after["restore"].failed - before["restore"].failed
			scripted := scriptCalls(after) - scriptCalls(before)
			switch {
			case restores != 1:
				t.Errorf("%d RESTOREs, want 1", restores)
			case tc.hash != "" && (busy != 1 || scripted != 1):
				t.Errorf("held: %d refused RESTOREs, %d script calls; want 1, 1", busy, scripted)
			case tc.hash == "" && tc.queue == "" && (busy != 0 || scripted != 0):
				t.Errorf("free, nobody queued: %d refused RESTOREs, %d script calls; want 0, 0", busy, scripted)
			}
		})
	}
}

// TestRunLoneFreshFairRegisteredHead: the lock is free and its queue's head
// registered for a direct grant: the give-back grants it the lock, and the
// caller queues behind it.
func TestRunLoneFreshFairRegisteredHead(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f := fairLock("ffreg")
	c := fairCase{queue: "B:+25000", grants: "B=45000:7", owner: "C"}
	w := c.setup(t, e, f)
	rep := e.freshFair(t, f, c)
	wantIntIn(t, "C's attempt", rep, leaseB-pttlSlack, leaseB)
	e.wantHash(t, f.name, "B=1")
	e.wantQueue(t, f, fmt.Sprintf("C:%+d", rep.Int+wait))
	w.want(t, f.wake("B=leash:grant:7"))
}

// TestRunLoneFreshFairBrokenQueue: a queue key that is not a list fails the
// attempt as the script would, and the lock RESTORE made is given back.
func TestRunLoneFreshFairBrokenQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f := fairLock("ffbroken")
	e.do(t, "SET", f.queue, "x")
	_, err := e.r.RunLoneFreshFair(ctxT(t), f.acquireKeys(),
		[]string{strconv.Itoa(lease), "A", strconv.Itoa(wait), at(0), "0", "", "1"}, f.prefix)
	if err == nil {
		t.Fatal("no error with a queue key that is a string")
	}
	if n := e.doInt(t, "EXISTS", f.name); n != 0 {
		t.Errorf("the lock is left: %q", e.hash(t, f.name))
	}
}
