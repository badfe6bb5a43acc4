package lockapi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/replyspin"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/pubsub"
	"github.com/redis/rueidis"
)

// Client is a connection to Redis and the engine that serves every lock handle made
// from it. It is safe for concurrent use. Close it when done.
type Client struct {
	opts    Options
	rc      rueidis.Client
	ownsRC  bool
	engine  *engine.Engine
	pubsub  *pubsub.Registry
	runner  *scripts.Redis
	spin    *replyspin.Spinner // polls for the lone lane's replies; nil: off
	closeMu sync.Mutex         // serializes Close calls
	closed  atomic.Bool        // set at the start of Close: later calls fail fast with ErrClosed
}

var _ engine.Subscriber = (*pubsub.Registry)(nil)

// New connects to Redis and starts the client's engine. It fails fast with
// ErrInvalidArgument for unusable Options, and with a wrapped connection error when
// no server answers a PING within DialTimeout.
func New(opts Options) (*Client, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	c := &Client{opts: opts, rc: opts.Client}
	var spin *replyspin.Spinner
	if c.rc == nil {
		spin = replyspin.New(opts.ReplySpin) // nil (its connections plain) when off
		c.rc, err = rueidis.NewClient(rueidis.ClientOption{
			InitAddress:  opts.Addrs,
			Username:     opts.Username,
			Password:     opts.Password,
			SelectDB:     opts.DB,
			DisableCache: true,
			// Bounds every call to a server that stopped answering (paused, cut off).
			ConnWriteTimeout: opts.OpTimeout,
			Dialer:           net.Dialer{Timeout: opts.DialTimeout},
			DialCtxFn:        spin.DialContext,
		})
		if err != nil {
			return nil, fmt.Errorf("leash: connect to %v: %w", opts.Addrs, err)
		}
		c.ownsRC = true
	}
	if c.rc.Mode() == rueidis.ClientModeCluster {
		// Renewals batch many locks in one script call, which a cluster rejects
		// unless they share a slot; cluster support (batches grouped by slot,
		// sharded pub/sub) is its own piece of work.
		if c.ownsRC {
			c.rc.Close()
		}
		return nil, fmt.Errorf("%w: Redis Cluster is not supported yet (standalone and Sentinel-managed servers are)", ErrInvalidArgument)
	}
	ctx, cancel := context.WithTimeout(context.Background(), opts.DialTimeout)
	err = c.rc.Do(ctx, c.rc.B().Ping().Build()).Error()
	cancel()
	if err != nil {
		if c.ownsRC {
			c.rc.Close()
		}
		return nil, fmt.Errorf("leash: no answer from Redis at %v: %w", opts.Addrs, err)
	}
	var eng *engine.Engine
	c.runner = scripts.NewRedis(c.rc)
	c.runner.SpinLone(spin)
	c.spin = spin
	c.pubsub = pubsub.New(c.rc,
		func(channel, message string) { eng.NotifyMessage(channel, message) },
		func() { eng.NotifyResubscribed() })
	eng, err = engine.New(engine.Config{
		ClientID:     opts.ClientID,
		Watchdog:     opts.WatchdogTimeout,
		Runner:       c.runner,
		Subscriber:   c.pubsub,
		OpTimeout:    opts.OpTimeout,
		CloseTimeout: opts.CloseTimeout,
		FairWait:     opts.FairWaitTimeout,
		PublicYield:  opts.PublicYield,
		HandoffChain: opts.HandoffChain,
		HandoffAge:   opts.HandoffAge,
		AbortIO:      c.abortIO,
	})
	if err != nil {
		c.pubsub.Close()
		if c.ownsRC {
			c.rc.Close()
		}
		return nil, err
	}
	c.engine = eng
	c.pubsub.Start()
	return c, nil
}

// ID returns the client id that prefixes this client's owner fields.
func (c *Client) ID() string { return c.opts.ClientID }

// Mutex returns a handle on the reentrant lock name. It acquires nothing. The
// handle is one owner: Acquire on a handle that holds the lock increments the hold
// count, and each Unlock decrements it. Use one handle per logical owner (a request,
// a job); any goroutine may use it. An empty name is reported by the handle's calls
// as ErrInvalidArgument.
//
// It is laid out in Redis as Redisson's RLock. Besides the lock hash, a client whose
// waiter is refused registers it in leash_lock_reg:{name} and leash_lock_regq:{name},
// so that a release in another leash client can hand the lock to it directly,
// under a field made for that waiter (see the README's "Direct grants"); Redisson
// clients waiting on the same lock are woken as Redisson expects.
func (c *Client) Mutex(name string) *Mutex {
	return &Mutex{c: c, name: name, owner: c.engine.NewOwner()}
}

// FairMutex returns a handle on the fair lock name: waiters get it in the order
// they queued, across processes, and a releaser that asks again goes to the back of
// the queue. It is laid out in Redis as Redisson's FairLock (a queue list and a
// deadline sorted set beside the lock hash), so Java and Go clients can queue on the
// same lock. The handle has the same methods and semantics as Mutex's.
//
// Queue deadlines are computed from each client's wall clock, as Redisson does:
// hosts sharing a fair lock need synchronized clocks (NTP). A waiter that gives up
// (context ended, wait ran out) leaves the queue at once. A live waiter refreshes its
// deadline at least every FairWaitTimeout/3, so it never loses its place however long
// the lock is held; a waiter whose process died loses its place once it heads the
// queue and its deadline has passed: FairWaitTimeout after it last refreshed, or
// after the lease of the holder it queued behind.
//
// One client must not use the same name both as Mutex and as FairMutex: such calls
// fail with ErrInvalidArgument.
func (c *Client) FairMutex(name string) *Mutex {
	return &Mutex{c: c, name: name, owner: c.engine.NewOwner(), fair: true}
}

// Close stops renewals, releases every lock this client holds (bounded by
// CloseTimeout), fails pending Acquire calls with ErrClosed, closes the Lost
// channel of every held handle, and returns once every goroutine the client started
// has ended. Script calls already at the server when Close starts are waited for
// too: against a stalled server each is bounded by OpTimeout, and a transport
// error is retried once, so Close can then take a few OpTimeouts longer than
// CloseTimeout. It closes the rueidis client only if New
// created it. It is idempotent and always returns nil; the error is there for
// io.Closer.
func (c *Client) Close() error {
	c.closeMu.Lock()
	defer c.closeMu.Unlock()
	if c.closed.Swap(true) {
		return nil
	}
	c.engine.Close()
	c.pubsub.Close()
	c.runner.Close()
	if c.ownsRC {
		c.rc.Close()
	}
	return nil
}

// abortIO makes calls in flight fail at once when Close's releases overrun
// CloseTimeout (a server that stopped answering). A caller's own rueidis client is
// left alone (its timeouts bound the calls instead), but not leash's dedicated
// connection taken from it.
func (c *Client) abortIO() {
	c.runner.Abort() // the lone lane's connection is leash's own, whoever owns rc
	if c.ownsRC {
		c.rc.Close()
	}
}

func (c *Client) isClosed() bool { return c.closed.Load() }

// check validates what every call needs: an open client, a context, a name.
func (c *Client) check(ctx context.Context, name string) error {
	if ctx == nil {
		return fmt.Errorf("%w: nil context (lock %q)", ErrInvalidArgument, name)
	}
	if name == "" {
		return fmt.Errorf("%w: empty lock name", ErrInvalidArgument)
	}
	if c.isClosed() {
		return engine.WrapError(name, ErrClosed)
	}
	return nil
}

// Stats returns the engine's counters (acquires, script calls, handoffs, waiters
// and holds) and the runner's count of plain commands sent that the scripts also
// run (SharedPlainCommands). For tests, metrics and the benchmark harness.
func (c *Client) Stats(ctx context.Context) (engine.Stats, error) {
	if c.isClosed() {
		return engine.Stats{}, ErrClosed
	}
	s, err := c.engine.Stats(ctx)
	if err == nil {
		s.SharedPlainCommands = c.runner.SharedCommandsSent()
	}
	return s, err
}

// redisErr wraps an error of a direct read, keeping context errors as they are.
func redisErr(name string, err error) error {
	if errors.Is(err, rueidis.ErrClosing) {
		return engine.WrapError(name, ErrClosed)
	}
	return engine.WrapError(name, err)
}
