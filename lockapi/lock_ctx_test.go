package lockapi_test

import (
	"context"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Lock's context ending just as the lock is granted: Lock returns nil exactly when
// the handle holds the lock, so nothing is ever held by nobody; and a grant through
// Lock leaves no context registration behind (no receipt).
func TestLockContextRacesGrant(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	holder, waiter := other.Mutex(name), c.Mutex(name)

	var held, cancelled int
	for i := range 60 {
		lockWithin(t, holder, 5*time.Second)
		// The waiter's deadline and the release land about together: i varies the
		// deadline from 2 to 11.5 ms around the release at 2 ms plus its round trip.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%20)*500*time.Microsecond+2*time.Millisecond)
		done := make(chan error, 1)
		go func() { done <- waiter.Lock(ctx) }()
		time.Sleep(2 * time.Millisecond) // not a wait for state: it aims the release at the deadline
		unlock(t, holder)
		err, ok := receive(done, 10*time.Second)
		cancel()
		if !ok {
			t.Fatal("Lock did not return")
		}
		holdCount := func() int {
			n, err := waiter.HoldCount(ctxFor(t, 5*time.Second))
			if err != nil {
				t.Fatalf("HoldCount: %v", err)
			}
			return n
		}
		switch {
		case err == nil:
			held++
			if n := holdCount(); n != 1 {
				t.Fatalf("round %d: Lock = nil with HoldCount %d; want 1", i, n)
			}
			if s := stats(t, c); s.Receipts != 0 {
				t.Fatalf("a grant through Lock left %d receipts", s.Receipts)
			}
			unlock(t, waiter)
		case err == context.DeadlineExceeded:
			// A grant that lost the race is given back (owner-guarded, in flight).
			cancelled++
			eventually(t, 5*time.Second, "a grant that lost the race to be given back", func() bool { return holdCount() == 0 })
		default:
			t.Fatalf("round %d: Lock = %v; want nil or DeadlineExceeded itself", i, err)
		}
		eventually(t, 5*time.Second, "the waiter's client to settle", func() bool {
			s := stats(t, c)
			return s.Waiters == 0 && s.Holds == 0
		})
		// A release that granted the lock directly to the waiter as it gave up has
		// its grant given back by the waiter's leave, which may still be in flight.
		freedSoon(t, srv, name)
	}
	t.Logf("%d rounds held, %d cancelled", held, cancelled)
	if held == 0 || cancelled == 0 {
		t.Fatalf("%d rounds held, %d cancelled: the deadlines did not straddle the grant, so the race went untested", held, cancelled)
	}
}
