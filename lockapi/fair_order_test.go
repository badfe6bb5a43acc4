package lockapi_test

import (
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// TestFairOrderAcrossProcesses: 20 waiters queued in a known order from two OS
// processes get the lock in exactly that order, and a releaser that asks again at
// once goes to the back of the queue, behind all of them.
//
// The parent holds the lock. Waiter k (k = 0..19) lives in helper k%2; the parent
// tells that helper to start it (RPUSH to the helper's command list) and waits
// until the Redis queue holds k+1 entries before starting the next one, so the
// queue order is 0..19 by construction. Each waiter RPUSHes its index when it gets
// the lock, then unlocks; waiter 0 asks again right after its Unlock.
func TestFairOrderAcrossProcesses(t *testing.T) {
	const waiters = 20
	srv := testredis.New(t)
	name := fairName(t, "")
	result, queue := name+":result", fairQueueKey(name)
	cmds := [2]string{name + ":cmds:0", name + ":cmds:1"}

	c := newClient(t, srv, lockapi.Options{})
	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}

	var procs [2]*fairProc
	for i := range procs {
		procs[i] = startFairHelper(t, "order",
			envFairAddr+"="+srv.Addr(), envFairLock+"="+name, envFairCmds+"="+cmds[i],
			envFairResult+"="+result, envFairAgain+"=0")
	}
	for k := range waiters {
		do(t, srv, "RPUSH", cmds[k%2], strconv.Itoa(k))
		fairWaitLen(t, srv, queue, k+1, 30*time.Second) // the first helper start includes a process start
	}
	for _, cmd := range cmds {
		do(t, srv, "RPUSH", cmd, "stop")
	}
	if got := fairLen(t, srv, result); got != 0 {
		t.Fatalf("%d waiters got the lock while the parent held it", got)
	}

	start := time.Now()
	unlock(t, holder)
	fairWaitFor(t, 30*time.Second, "21 acquisitions", func() bool { return fairLen(t, srv, result) >= waiters+1 })
	elapsed := time.Since(start)
	for _, p := range procs {
		p.wait(t, 30*time.Second)
	}

	var want []string
	for k := range waiters {
		want = append(want, strconv.Itoa(k))
	}
	want = append(want, "0") // waiter 0 again, behind everyone queued before it asked
	if got := fairList(t, srv, result); !slices.Equal(got, want) {
		t.Errorf("order of acquisition:\n got  %q\n want %q", got, want)
	}
	t.Logf("21 acquisitions across 2 processes in %v", elapsed)
	fairMustBeClean(t, srv, name)
}

// TestFairReleaserRequeuesInProcess: in one client, a holder with five local
// waiters queued behind it releases and asks again at once: the five get the lock
// in queue order first, then the releaser.
func TestFairReleaserRequeuesInProcess(t *testing.T) {
	const waiters = 5
	srv := testredis.New(t)
	name := fairName(t, "")
	c := newClient(t, srv, lockapi.Options{})
	result := name + ":result"

	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	type res struct {
		idx string
		err error
	}
	done := make(chan res, waiters+1)
	serve := func(m *lockapi.Mutex, idx string, got <-chan error) {
		err := <-got
		if err == nil {
			_, err = srv.Do("RPUSH", result, idx)
			if uerr := m.Unlock(fairCtx(t, 5*time.Second)); err == nil {
				err = uerr
			}
		}
		done <- res{idx, err}
	}
	for k := range waiters {
		m := c.FairMutex(name)
		got, _ := fairEnqueue(t, srv, m, fairCtx(t, 30*time.Second), k+1)
		go serve(m, strconv.Itoa(k), got)
	}
	unlock(t, holder)
	go serve(holder, "holder", holder.Acquire(fairCtx(t, 30*time.Second)))
	for range waiters + 1 {
		select {
		case r := <-done:
			if r.err != nil {
				t.Errorf("waiter %s: %v", r.idx, r.err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("waiters stuck; served so far %q", fairList(t, srv, result))
		}
	}
	want := []string{"0", "1", "2", "3", "4", "holder"}
	if got := fairList(t, srv, result); !slices.Equal(got, want) {
		t.Errorf("order = %q, want %q", got, want)
	}
	fairMustBeClean(t, srv, name)
}
