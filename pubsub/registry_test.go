package pubsub

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/redis/rueidis"
)

func TestMain(m *testing.M) { testredis.Main(m) }

// recorder collects what the registry hands to its callbacks.
type recorder struct {
	mu         sync.Mutex
	messages   []string // "channel=message"
	reconnects int
	changed    chan struct{}
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{}, 1)} }

func (r *recorder) onMessage(channel, message string) {
	r.mu.Lock()
	r.messages = append(r.messages, channel+"="+message)
	r.mu.Unlock()
	r.poke()
}

func (r *recorder) onReconnect() {
	r.mu.Lock()
	r.reconnects++
	r.mu.Unlock()
	r.poke()
}

func (r *recorder) poke() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// waitFor waits until cond holds over the recorder's state.
func (r *recorder) waitFor(t *testing.T, what string, cond func(msgs []string, reconnects int) bool) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		r.mu.Lock()
		ok := cond(append([]string(nil), r.messages...), r.reconnects)
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-r.changed:
		case <-deadline:
			t.Fatalf("timed out waiting for %s (messages %v)", what, r.messages)
		}
	}
}

func contains(msgs []string, want string) bool {
	for _, m := range msgs {
		if m == want {
			return true
		}
	}
	return false
}

func setup(t *testing.T) (*testredis.Server, rueidis.Client, *Registry, *recorder) {
	t.Helper()
	srv := testredis.New(t)
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	reg := New(client, rec.onMessage, rec.onReconnect)
	t.Cleanup(func() {
		reg.Close()
		client.Close()
	})
	return srv, client, reg, rec
}

// subscribe subscribes, retrying while the first connection is still being dialled
// (Subscribe then answers ErrDisconnected and the channel is subscribed on connect).
// It reports whether it had to retry: the first connection's snapshot then holds
// the channel, so its reconnect callback is still to come.
func subscribe(t *testing.T, sub func(context.Context, string) error, name string) (retried bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for ; ; retried = true {
		err := sub(ctx, name)
		if err == nil {
			return retried
		}
		if !errors.Is(err, ErrDisconnected) {
			t.Fatalf("subscribe %s: %v", name, err)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("subscribe %s: still disconnected", name)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func TestSubscribeDeliversAfterConfirmation(t *testing.T) {
	srv, _, reg, rec := setup(t)
	reg.Start()
	subscribe(t, reg.Subscribe, t.Name())
	// Subscribe returned, so the server has confirmed: a publish now must arrive.
	if n, err := srv.Do("PUBLISH", t.Name(), "0"); err != nil || n != "1" {
		t.Fatalf("PUBLISH reached %q subscribers (err %v), want 1", n, err)
	}
	rec.waitFor(t, "the message", func(msgs []string, _ int) bool { return contains(msgs, t.Name()+"=0") })
	if reg.Channels() != 1 {
		t.Fatalf("Channels() = %d, want 1", reg.Channels())
	}
}

func TestPatternSubscription(t *testing.T) {
	srv, _, reg, rec := setup(t)
	reg.Start()
	prefix := "redisson_lock__channel:{" + t.Name() + "}:client:"
	subscribe(t, reg.PSubscribe, prefix+"*")
	for i := 1; i <= 3; i++ {
		if _, err := srv.Do("PUBLISH", prefix+strconv.Itoa(i), "0"); err != nil {
			t.Fatal(err)
		}
	}
	rec.waitFor(t, "three per-waiter messages", func(msgs []string, _ int) bool {
		return contains(msgs, prefix+"1=0") && contains(msgs, prefix+"2=0") && contains(msgs, prefix+"3=0")
	})
	reg.PUnsubscribe(context.Background(), prefix+"*")
	if got, _ := srv.Do("PUBSUB", "NUMPAT"); got != "0" {
		t.Fatalf("PUBSUB NUMPAT = %s after PUnsubscribe, want 0", got)
	}
}

func TestUnsubscribe(t *testing.T) {
	srv, _, reg, _ := setup(t)
	reg.Start()
	subscribe(t, reg.Subscribe, t.Name())
	reg.Unsubscribe(context.Background(), t.Name())
	if reg.Channels() != 0 {
		t.Fatalf("Channels() = %d, want 0", reg.Channels())
	}
	if n, _ := srv.Do("PUBLISH", t.Name(), "0"); n != "0" {
		t.Fatalf("PUBLISH reached %s subscribers after Unsubscribe, want 0", n)
	}
}

// A dropped connection is replaced, every channel subscribed again, and the
// reconnect callback runs, so the engine can retry its waiters.
func TestResubscribesAfterConnectionKilled(t *testing.T) {
	srv, _, reg, rec := setup(t)
	reg.Start()
	if subscribe(t, reg.Subscribe, t.Name()) {
		// The first connection's callback must not pass for the reconnect's.
		rec.waitFor(t, "the first connection's callback", func(_ []string, n int) bool { return n > 0 })
	}
	rec.mu.Lock()
	before := rec.reconnects
	rec.mu.Unlock()
	if _, err := srv.Do("CLIENT", "KILL", "TYPE", "pubsub"); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "the reconnect callback", func(_ []string, n int) bool { return n > before })
	if n, _ := srv.Do("PUBLISH", t.Name(), "0"); n != "1" {
		t.Fatalf("PUBLISH reached %s subscribers after the reconnect, want 1", n)
	}
	rec.waitFor(t, "a message on the new connection", func(msgs []string, _ int) bool { return contains(msgs, t.Name()+"=0") })
}

// With the server down, Subscribe keeps the channel and says ErrDisconnected; once
// the server is back the channel is subscribed and the callback runs.
func TestSubscribeWhileServerDown(t *testing.T) {
	srv, _, reg, rec := setup(t)
	reg.Start()
	subscribe(t, reg.Subscribe, t.Name()+"-a")
	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	// The registry may not have noticed the drop yet; either way the channel must
	// end up subscribed once the server is back.
	_ = reg.Subscribe(ctx, t.Name()+"-b")
	rec.mu.Lock()
	before := rec.reconnects
	rec.mu.Unlock()
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "the reconnect callback", func(_ []string, n int) bool { return n > before })
	for _, ch := range []string{t.Name() + "-a", t.Name() + "-b"} {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n, _ := srv.Do("PUBSUB", "NUMSUB", ch)
			if n == ch+"\n1" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not subscribed after restart: NUMSUB %q", ch, n)
			}
			time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
		}
	}
}

func TestCloseIsIdempotentAndFinal(t *testing.T) {
	_, _, reg, _ := setup(t)
	reg.Start()
	subscribe(t, reg.Subscribe, t.Name())
	reg.Close()
	reg.Close()
	if err := reg.Subscribe(context.Background(), "after-close"); !errors.Is(err, ErrClosed) {
		t.Fatalf("Subscribe after Close = %v, want ErrClosed", err)
	}
}

// TestCleanUpDoesNotDropAChannelSubscribedAgain: a new connection subscribes its
// snapshot of the channels, then drops those unsubscribed meanwhile (their
// UNSUBSCRIBE may have reached the server before the snapshot's SUBSCRIBE). A
// channel subscribed again between that decision and its UNSUBSCRIBE must stay
// subscribed: the engine, told its Subscribe succeeded, would otherwise wait for
// messages that never come (a fault storm caught it: a client's waiters heard no
// release for 20 s while the other client kept the lock among its own).
// Not parallel: it sets the package's test hooks.
func TestCleanUpDoesNotDropAChannelSubscribedAgain(t *testing.T) {
	srv, _, reg, rec := setup(t)
	const ch = "leash-test:cleanup-resubscribe"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resubscribed := make(chan error, 1)
	cleanedUp := make(chan struct{})
	// The hooks act on the first connection only (a reconnect would run them
	// again).
	var snapshotOnce, droppingOnce, droppedOnce sync.Once
	testHooks = registryHooks{
		// The snapshot holds ch; it is unsubscribed before the snapshot is sent.
		onSnapshotSending: func() { snapshotOnce.Do(func() { reg.Unsubscribe(ctx, ch) }) },
		// The clean-up has decided to drop ch. A Subscribe of ch now must not
		// reach the server before that UNSUBSCRIBE: it waits for the clean-up.
		// What is checked here is that something does not happen, so the wait is
		// a bounded one (250 ms, spent in full when all is well): a Subscribe that
		// does not wait registers ch and is confirmed well within it on this
		// machine, though a very slow one could let it pass unseen.
		onDropping: func() {
			droppingOnce.Do(func() {
				go func() { resubscribed <- reg.Subscribe(ctx, ch) }()
				deadline := time.Now().Add(200 * time.Millisecond)
				for reg.Channels() == 0 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond) // polling, bounded
				}
				select {
				case err := <-resubscribed:
					resubscribed <- err // the Subscribe did not wait; the check below fails
				case <-time.After(50 * time.Millisecond):
				}
			})
		},
		onDropped: func() { droppedOnce.Do(func() { close(cleanedUp) }) },
	}
	t.Cleanup(func() {
		reg.Close() // its loop reads the hooks
		testHooks = registryHooks{}
	})

	if err := reg.Subscribe(ctx, ch); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("first Subscribe = %v, want ErrDisconnected (no connection before the first call)", err)
	}
	select {
	case <-cleanedUp:
	case <-ctx.Done():
		t.Fatal("the connection's clean-up did not run")
	}
	select {
	case err := <-resubscribed:
		if err != nil {
			t.Fatalf("Subscribe again = %v", err)
		}
	case <-ctx.Done():
		t.Fatal("Subscribe again did not return")
	}
	if n, err := srv.Do("PUBSUB", "NUMSUB", ch); err != nil || n != ch+"\n1" {
		t.Fatalf("PUBSUB NUMSUB after the clean-up = %q, %v; want the channel subscribed", n, err)
	}
	if _, err := srv.Do("PUBLISH", ch, "hello"); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "the message", func(msgs []string, _ int) bool { return contains(msgs, ch+"=hello") })
}
