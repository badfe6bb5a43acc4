package lockapi_test

import (
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// An uncontended Lock and Unlock are calls alone in flight on the lone lane: their
// replies are polled for (Options.ReplySpin), and the locks behave as usual.
func TestLoneLanePollsForReplies(t *testing.T) {
	srv := testredis.New(t)
	// The largest budget, so that the first reply, timed against no average
	// yet, is read by polling even under -race.
	c := newClient(t, srv, lockapi.Options{ReplySpin: lockapi.MaxReplySpin})
	m := c.Mutex(lockName(t, ""))
	const cycles = 20
	for i := range cycles {
		if err := m.Lock(ctxFor(t, 10*time.Second)); err != nil {
			t.Fatalf("Lock %d: %v", i, err)
		}
		if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
			t.Fatalf("Unlock %d: %v", i, err)
		}
	}
	polled, parked := lockapi.ReplySpinCounts(c)
	if runtime.NumCPU() < 2 { // nothing polls on one CPU (Options.ReplySpin)
		if polled != 0 || parked != 0 {
			t.Fatalf("one CPU: polled %d, parked %d; want none", polled, parked)
		}
		return
	}
	// Nearly every call is alone in flight here, but one may meet the loop
	// busy (a timer, a subscription change) and go out with a batch, whose
	// reply is not polled for: ask for half.
	if polled == 0 || polled+parked < cycles {
		t.Fatalf("polled %d, parked %d: want some polled, and at least %d marked reads of %d Lock and Unlock calls", polled, parked, cycles, 2*cycles)
	}
	if got := do(t, srv, "EXISTS", lockName(t, "")); got != "0" {
		t.Fatalf("the lock is still in Redis: EXISTS = %s", got)
	}
}

// With ReplySpin negative, or with a rueidis client of the caller's own (whose
// connections leash did not dial), nothing polls.
func TestReplySpinOff(t *testing.T) {
	srv := testredis.New(t)
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	for name, opts := range map[string]lockapi.Options{
		"negative":   {ReplySpin: -1},
		"own client": {Client: rc},
	} {
		t.Run(name, func(t *testing.T) {
			c := newClient(t, srv, opts)
			m := c.Mutex(lockName(t, ""))
			for i := range 5 {
				if err := m.Lock(ctxFor(t, 10*time.Second)); err != nil {
					t.Fatalf("Lock %d: %v", i, err)
				}
				if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
					t.Fatalf("Unlock %d: %v", i, err)
				}
			}
			if polled, parked := lockapi.ReplySpinCounts(c); polled != 0 || parked != 0 {
				t.Fatalf("polled %d, parked %d; want none", polled, parked)
			}
		})
	}
}

func TestReplySpinBounds(t *testing.T) {
	srv := testredis.New(t)
	_, err := lockapi.New(lockapi.Options{Addrs: []string{srv.Addr()}, ReplySpin: lockapi.MaxReplySpin + 1})
	if !errors.Is(err, lockapi.ErrInvalidArgument) {
		t.Fatalf("ReplySpin above MaxReplySpin: %v, want ErrInvalidArgument", err)
	}
}
