package main

import (
	"context"
	"errors"
	"math"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	redsyncgoredis "github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
	"github.com/redis/rueidis/rueidislock"
)

// The Go peers, each used through its documented API with the settings a service
// would pick to wait for a lock rather than give up.

// ---- bsm/redislock ----

// redislockContender is github.com/bsm/redislock on a go-redis client, retrying
// with a linear 10 ms backoff until the caller's context ends.
type redislockContender struct {
	rdb *redis.Client
	c   *redislock.Client
}

// redislockRetry is redislock's documented linear backoff; it keeps no state, so
// one value serves every call.
var redislockRetry = redislock.LinearBackoff(naivePoll)

func openRedislock(addr string) (Contender, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		rdb.Close()
		return nil, err
	}
	return &redislockContender{rdb: rdb, c: redislock.New(rdb)}, nil
}

func (r *redislockContender) Name() string { return "redislock" }
func (r *redislockContender) Close() error { return r.rdb.Close() }
func (r *redislockContender) NewLocker(name string) Locker {
	return &redislockLocker{c: r.c, key: name}
}

type redislockLocker struct {
	c    *redislock.Client
	key  string
	held *redislock.Lock
}

// Lock calls Obtain until it succeeds or ctx ends: Obtain gives up by itself after
// the lock's TTL when ctx has no deadline, so an ErrNotObtained with ctx still live
// just means "call again".
func (l *redislockLocker) Lock(ctx context.Context) error {
	opts := &redislock.Options{RetryStrategy: redislockRetry}
	for {
		lk, err := l.c.Obtain(ctx, l.key, lease, opts)
		if err == nil {
			l.held = lk
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !errors.Is(err, redislock.ErrNotObtained) {
			return err
		}
	}
}

func (l *redislockLocker) Unlock(ctx context.Context) error {
	if l.held == nil {
		return errNotHeld
	}
	err := l.held.Release(ctx)
	l.held = nil
	return err
}

// ---- go-redsync/redsync ----

// redsyncContender is github.com/go-redsync/redsync/v4 on one Redis through a
// go-redis pool, with its default expiry and retry delays (random 50-250 ms) and
// unlimited tries.
type redsyncContender struct {
	rdb *redis.Client
	rs  *redsync.Redsync
}

func openRedsync(addr string) (Contender, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		rdb.Close()
		return nil, err
	}
	return &redsyncContender{rdb: rdb, rs: redsync.New(redsyncgoredis.NewPool(rdb))}, nil
}

func (r *redsyncContender) Name() string { return "redsync" }
func (r *redsyncContender) Close() error { return r.rdb.Close() }
func (r *redsyncContender) NewLocker(name string) Locker {
	return redsyncLocker{m: r.rs.NewMutex(name, redsync.WithTries(math.MaxInt32))}
}

type redsyncLocker struct{ m *redsync.Mutex }

// Lock returns ctx's error when ctx ended (redsync itself reports ErrFailed).
func (l redsyncLocker) Lock(ctx context.Context) error {
	err := l.m.LockContext(ctx)
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

func (l redsyncLocker) Unlock(ctx context.Context) error {
	ok, err := l.m.UnlockContext(ctx)
	if err == nil && !ok {
		return errNotHeld
	}
	return err
}

// ---- redis/rueidis/rueidislock ----

// rueidislockContender is github.com/redis/rueidis/rueidislock on one Redis: one
// key per lock (KeyMajority 1), woken by client-side-caching invalidations with
// NOLOOP tracking (Redis >= 7.0.5).
type rueidislockContender struct{ l rueidislock.Locker }

func openRueidislock(addr string) (Contender, error) {
	l, err := rueidislock.NewLocker(rueidislock.LockerOption{
		ClientOption:   rueidis.ClientOption{InitAddress: []string{addr}},
		KeyMajority:    1,
		NoLoopTracking: true,
	})
	if err != nil {
		return nil, err
	}
	return &rueidislockContender{l: l}, nil
}

func (r *rueidislockContender) Name() string { return "rueidislock" }
func (r *rueidislockContender) Close() error { r.l.Close(); return nil }
func (r *rueidislockContender) NewLocker(name string) Locker {
	return &rueidislockLocker{l: r.l, name: name}
}

type rueidislockLocker struct {
	l      rueidislock.Locker
	name   string
	cancel context.CancelFunc
}

// Lock holds the lock until Unlock calls the cancel function WithContext returned.
// The hold's context derives from ctx, so it also ends when ctx does.
func (l *rueidislockLocker) Lock(ctx context.Context) error {
	_, cancel, err := l.l.WithContext(ctx, l.name)
	if err != nil {
		return err
	}
	l.cancel = cancel
	return nil
}

// Unlock cancels the hold; rueidislock's cancel returns once the key is deleted.
func (l *rueidislockLocker) Unlock(context.Context) error {
	if l.cancel == nil {
		return errNotHeld
	}
	l.cancel()
	l.cancel = nil
	return nil
}

// Compile-time checks: every contender and locker implements the interfaces.
var (
	_ Contender = (*leashContender)(nil)
	_ Contender = (*naiveContender)(nil)
	_ Contender = (*redislockContender)(nil)
	_ Contender = (*redsyncContender)(nil)
	_ Contender = (*rueidislockContender)(nil)
	_ Locker    = leashLocker{}
	_ Locker    = (*naiveLocker)(nil)
	_ Locker    = (*redislockLocker)(nil)
	_ Locker    = redsyncLocker{}
	_ Locker    = (*rueidislockLocker)(nil)
)
